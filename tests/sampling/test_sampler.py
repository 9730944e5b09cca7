"""Each sampling knob against its definition, through Sampler with fixed logits (no model).

Empirical frequencies come from one batch of N identical rows (N draws in one call).
With N = 40000 the standard error of a frequency is <= 0.0025, so the tolerance
0.015 is six of them: these tests do not flake.
"""

from __future__ import annotations

import math

import pytest
import torch

from streamer.messages import SamplingParams
from streamer.sampling.sampler import SampleInputs, Sampler, apply_bitmask, draw_seed

V = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 40000
TOL = 0.015


def sampler(v: int = V) -> Sampler:
    return Sampler(v, torch.device("cpu"))


def draw(params: SamplingParams, n: int = N, logits: torch.Tensor = LOGITS, **kw) -> torch.Tensor:
    """Frequencies of the tokens drawn by n rows with the same params."""
    torch.manual_seed(0)
    rows = logits[None, :].repeat(n, 1)
    inp = SampleInputs([params] * n, kw.pop("histories", [[] for _ in range(n)]), **kw)
    toks = torch.tensor([s.token_id for s in sampler(logits.shape[0])(rows, inp)])
    return torch.bincount(toks, minlength=logits.shape[0]).float() / n


def assert_close(freq: torch.Tensor, probs: torch.Tensor) -> None:
    err = (freq - probs).abs().max().item()
    assert err < TOL, f"max |freq - p| = {err:.4f}\nfreq {freq.tolist()}\np    {probs.tolist()}"
    # a token of probability 0 is never drawn
    assert (freq[probs == 0] == 0).all()


def reference(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The definition, spelled out token by token in plain Python."""
    z = [x / temperature for x in logits.tolist()]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:top_k] if top_k > 0 else order
    m = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - m) for i in keep}
    s = sum(w.values())
    p = {i: w[i] / s for i in keep}
    nucleus, mass = [], 0.0
    for i in keep:  # smallest prefix (by probability) whose mass reaches top_p
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += p[i]
    pmax = max(p[i] for i in nucleus)
    final = [i for i in nucleus if p[i] >= min_p * pmax]
    out = torch.zeros(len(z))
    for i in final:
        out[i] = p[i]
    return out / out.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature(temperature):
    assert_close(draw(SamplingParams(temperature=temperature)), reference(LOGITS, temperature))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k(k):
    freq = draw(SamplingParams(temperature=1.0, top_k=k))
    assert_close(freq, reference(LOGITS, top_k=k))
    assert (freq > 0).sum() <= k


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p(p):
    assert_close(draw(SamplingParams(temperature=1.0, top_p=p)), reference(LOGITS, top_p=p))


@pytest.mark.parametrize("m", [0.1, 0.3, 0.7])
def test_min_p(m):
    assert_close(draw(SamplingParams(temperature=1.0, min_p=m)), reference(LOGITS, min_p=m))


def test_all_filters_together():
    kw = dict(temperature=0.8, top_k=6, top_p=0.85, min_p=0.1)
    assert_close(draw(SamplingParams(**kw)), reference(LOGITS, **kw))


def test_mixed_knobs_in_one_batch():
    """Rows with different knobs in one call each follow their own definition."""
    torch.manual_seed(1)
    cases = [
        dict(temperature=1.0),
        dict(temperature=0.5, top_k=3),
        dict(temperature=1.5, top_p=0.7),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.0),
    ]
    n = 20000
    params = [SamplingParams(**c) for c in cases for _ in range(n)]
    rows = LOGITS[None, :].repeat(len(params), 1)
    out = sampler()(rows, SampleInputs(params, [[] for _ in params]))
    toks = torch.tensor([s.token_id for s in out]).view(len(cases), n)
    for c, t in zip(cases, toks):
        freq = torch.bincount(t, minlength=V).float() / n
        if c["temperature"] == 0:
            assert (t == 0).all()
        else:
            err = (freq - reference(LOGITS, **c)).abs().max().item()
            assert err < 0.02, (c, err)


def full_logprobs(params: SamplingParams, history: list[int], logits=LOGITS, **kw) -> torch.Tensor:
    """The processed distribution as reported by logprobs (top-V of a V-token vocab)."""
    v = logits.shape[0]
    p = SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__}, "logprobs": v})
    (tok,) = sampler(v)(logits[None, :].clone(), SampleInputs([p], [history], **kw))
    out = torch.full((v,), float("-inf"))
    for i, lp in tok.top_logprobs:
        out[i] = lp
    return out


def test_logit_bias():
    bias = {1: 3.0, 5: -1.0, 7: 100.0, 99: 5.0, -1: 5.0}  # out-of-range ids are ignored
    got = full_logprobs(SamplingParams(temperature=0.0, logit_bias=bias), [])
    z = LOGITS.clone()
    z[1] += 3.0
    z[5] -= 1.0
    z[7] += 100.0
    torch.testing.assert_close(got, z.log_softmax(-1))
    # and the draw follows it: 7 now dominates
    assert draw(SamplingParams(temperature=1.0, logit_bias={7: 100.0}), n=200)[7] == 1.0


def test_allowed_token_ids_leave_only_those_tokens():
    """vLLM's allowed_token_ids: the other tokens' logits are -inf, after bias and penalties, so
    the distribution is the processed one renormalized over the allowed tokens; greedy takes the
    best of them, draws never leave them, and rows without it are untouched."""
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[3, 5, 6], logit_bias={6: 4.0})
    got = full_logprobs(allowed, [])
    z = torch.full_like(LOGITS, float("-inf"))
    z[[3, 5, 6]] = LOGITS[[3, 5, 6]] + torch.tensor([0.0, 0.0, 4.0])
    torch.testing.assert_close(got, z.log_softmax(-1))
    freq = draw(SamplingParams(temperature=1.0, allowed_token_ids=[1, 4]))
    assert freq[[1, 4]].sum() == 1.0
    assert_close(freq, torch.zeros(V).index_copy_(0, torch.tensor([1, 4]), LOGITS[[1, 4]].softmax(-1)))
    rows = LOGITS[None, :].repeat(2, 1)
    toks = sampler()(rows, SampleInputs([SamplingParams(temperature=0.0, allowed_token_ids=[7]),
                                         SamplingParams(temperature=0.0)], [[], []]))
    assert (toks.tolist() if isinstance(toks, torch.Tensor) else [t.token_id for t in toks]) == [7, 0]


def test_penalties_match_definition():
    hist = [0, 0, 0, 3, 6, 6]
    p = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    got = full_logprobs(p, hist)
    z = LOGITS.clone()
    counts = torch.bincount(torch.tensor(hist), minlength=V).float()
    for t in range(V):
        if counts[t] > 0:
            # repetition (HF / CTRL): divide positive logits, multiply negative ones
            z[t] = z[t] / 1.3 if z[t] > 0 else z[t] * 1.3
            z[t] -= 0.25 * counts[t] + 0.5
    torch.testing.assert_close(got, z.log_softmax(-1))


def test_penalties_change_greedy_choice():
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    rows = LOGITS[None, :].repeat(2, 1)
    out = sampler()(rows, SampleInputs([p, SamplingParams(temperature=0.0)], [[0], [0]]))
    assert out[0].token_id == 1  # 2.0 - 2.0 < 1.5
    assert out[1].token_id == 0  # no penalty: history is ignored


def test_penalized_rows_among_plain_rows():
    """Vectorized penalties touch only their own rows."""
    pen = SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=V)
    plain = SamplingParams(temperature=0.0, logprobs=V)
    rows = LOGITS[None, :].repeat(4, 1)
    hist = [[0, 1], [0, 1], [2], [2]]
    out = sampler()(rows, SampleInputs([plain, pen, plain, pen], hist))
    ref = LOGITS.log_softmax(-1)
    assert out[0].logprob == pytest.approx(ref[0].item(), abs=1e-5)
    assert out[2].logprob == pytest.approx(ref[0].item(), abs=1e-5)
    assert out[1].token_id == 2 and out[3].token_id == 0


def test_banned_never_drawn():
    banned = [[0, 1, 2]] * N
    freq = draw(SamplingParams(temperature=1.0), banned=banned)
    z = LOGITS.clone()
    z[:3] = float("-inf")
    assert_close(freq, z.softmax(-1))
    assert (
        sampler()(LOGITS[None, :], SampleInputs([SamplingParams(temperature=0.0)], [[]], [[0]]))[0].token_id
        == 1
    )


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, V] -> int32 [rows, ceil(V/32)] (bit t%32 of word t//32)."""
    rows, v = allowed.shape
    words = torch.zeros(rows, (v + 31) // 32, dtype=torch.int64)
    for t in range(v):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def test_bitmask_draws_only_allowed_tokens():
    allowed = torch.tensor([[False, True, False, True, True, False, False, True]])
    mask = pack(allowed).repeat(N, 1)
    freq = draw(SamplingParams(temperature=1.0), bitmask=mask)
    z = LOGITS.masked_fill(~allowed[0], float("-inf"))
    assert_close(freq, z.softmax(-1))


@pytest.mark.parametrize("v", [8, 40, 64, 100])
def test_apply_bitmask_matches_unpacked(v):
    g = torch.Generator().manual_seed(v)
    allowed = torch.rand(5, v, generator=g) < 0.5
    allowed[2] = True  # an unconstrained row
    logits = torch.randn(5, v, generator=g)
    want = logits.masked_fill(~allowed, float("-inf"))
    got = logits.clone()
    apply_bitmask(got, pack(allowed))
    torch.testing.assert_close(got, want)
    got = logits.clone()
    apply_bitmask(got, pack(allowed), rows=[0, 3])
    torch.testing.assert_close(got[[0, 3]], want[[0, 3]])
    torch.testing.assert_close(got[[1, 2, 4]], logits[[1, 2, 4]])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_apply_bitmask_through_pinned_staging_on_cuda():
    """The GPU path copies the host bitmask through a pinned ring buffer on a side stream
    (so the copy overlaps the forward still running): same result, also while the stream
    is busy and when the ring comes round and a buffer is reused for a new mask."""
    from streamer.staging import PinnedRing

    ring = PinnedRing(slots=2)
    busy = torch.randn(4096, 4096, device="cuda")
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        allowed = torch.rand(7, 1000, generator=g) < 0.3
        logits = torch.randn(7, 1000, generator=g).cuda()
        want = logits.masked_fill(~allowed.cuda(), float("-inf"))
        for _ in range(4):
            busy = torch.tanh(busy @ busy)  # the "forward" the mask's copy overlaps (bounded: no inf)
        got = logits + busy[:7, :1000] * 0
        apply_bitmask(got, pack(allowed), rows=None if seed % 2 else [0, 2, 3, 4, 5, 6, 1], staging=ring)
        torch.testing.assert_close(got, want)


def test_apply_bitmask_torch_fallback(monkeypatch):
    import streamer.sampling.processing as s

    monkeypatch.setattr(s, "_xgr_apply_ok", False)
    allowed = torch.rand(3, 70) < 0.5
    logits = torch.randn(3, 70)
    got = logits.clone()
    apply_bitmask(got, pack(allowed), rows=[1])
    torch.testing.assert_close(got[1], logits[1].masked_fill(~allowed[1], float("-inf")))
    torch.testing.assert_close(got[[0, 2]], logits[[0, 2]])


def test_ban_that_would_empty_a_grammar_row_is_dropped():
    """min_tokens bans EOS, but the grammar allows only EOS: the grammar wins."""
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[:, 6] = True
    allowed[1, 2] = True
    out = sampler()(
        LOGITS[None, :].repeat(2, 1),
        SampleInputs([SamplingParams(temperature=1.0)] * 2, [[], []], [[6], [6]], bitmask=pack(allowed)),
    )
    assert [o.token_id for o in out] == [6, 2]


def test_logit_bias_rows_are_built_once_per_request():
    """A request's bias becomes tensors at its first step; rows of one batch keep their own."""
    s = sampler()
    a, b = {3: 50.0}, {4: 50.0, 5: -50.0}
    params = [SamplingParams(temperature=0.0, logit_bias=a), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias=b), SamplingParams(temperature=0.0, logit_bias=a)]
    logits = torch.zeros(4, V)
    for _ in range(2):
        out = s(logits.clone(), SampleInputs(params, [[]] * 4, [[]] * 4))
        assert [t.token_id for t in out] == [3, int(torch.zeros(V).argmax()), 4, 3]
    assert len(s._biases) == 2 and s._biases[id(a)][0] is a


def test_mask_and_bias_and_penalty_compose():
    allowed = torch.tensor([[True, True, True, False, False, False, False, False]])
    p = SamplingParams(temperature=0.0, logit_bias={2: 1.5}, presence_penalty=1.0)
    got = full_logprobs(p, [0], bitmask=pack(allowed))
    z = LOGITS.clone()
    z[2] += 1.5
    z[0] -= 1.0
    z[~allowed[0]] = float("-inf")
    torch.testing.assert_close(got, z.log_softmax(-1))


def test_greedy_fast_path_and_mixed_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    s = Sampler(50, torch.device("cpu"))
    greedy = [SamplingParams(temperature=0.0)] * 6
    out = s(logits, SampleInputs(greedy, [[]] * 6))
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()
    mixed = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    out = s(logits, SampleInputs(mixed, [[]] * 6))
    assert [o.token_id for o in out][1::2] == logits.argmax(-1).tolist()[1::2]


def test_logits_wider_than_vocab_are_cut():
    logits = torch.zeros(1, 12)
    logits[0, 10] = 100.0  # padding column of the LM head
    out = Sampler(8, torch.device("cpu"))(logits, SampleInputs([SamplingParams(temperature=1.0)], [[]]))
    assert out[0].token_id < 8


def test_logprobs_of_processed_distribution_not_tempered():
    """logprobs describe the processed distribution (before temperature and the filters)."""
    p = SamplingParams(temperature=0.3, top_k=2, logprobs=3, seed=5)
    (tok,) = sampler()(LOGITS[None, :].clone(), SampleInputs([p], [[]]))
    ref = LOGITS.log_softmax(-1)
    assert tok.logprob == pytest.approx(ref[tok.token_id].item(), abs=1e-5)
    assert [i for i, _ in tok.top_logprobs] == [0, 1, 2]
    assert [lp for _, lp in tok.top_logprobs] == pytest.approx(ref[:3].tolist(), abs=1e-5)
    (tok,) = sampler()(LOGITS[None, :].clone(), SampleInputs([SamplingParams(logprobs=0)], [[]]))
    assert tok.logprob is not None and tok.top_logprobs is None


def test_seed_reproducible_whatever_shares_the_batch():
    g = torch.Generator().manual_seed(3)
    v = 1000
    row = torch.randn(v, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    hist = [5, 6, 7]
    s = Sampler(v, torch.device("cpu"))
    alone = s(row[None, :].clone(), SampleInputs([seeded], [hist])).pop().token_id
    for others in range(1, 6):
        batch = torch.randn(others + 1, v, generator=g)
        at = others // 2
        batch[at] = row
        params = [
            SamplingParams(temperature=1.0, seed=i if i % 2 else None, top_p=0.9) for i in range(others + 1)
        ]
        params[at] = seeded
        hists = [[1] * i for i in range(others + 1)]
        hists[at] = hist
        torch.manual_seed(others)  # the unseeded rows draw from the global generator
        out = s(batch, SampleInputs(params, hists))
        assert out[at].token_id == alone
    # the draw depends on the seed and the position, so a sequence of draws varies
    draws = {s(row[None, :].clone(), SampleInputs([seeded], [[0] * k])).pop().token_id for k in range(20)}
    assert len(draws) > 5


def test_seeded_draws_follow_the_distribution():
    n = 20000
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    rows = LOGITS[None, :].repeat(n, 1)
    toks = torch.tensor([o.token_id for o in sampler()(rows, SampleInputs(params, [[]] * n))])
    freq = torch.bincount(toks, minlength=V).float() / n
    assert (freq - LOGITS.softmax(-1)).abs().max() < 0.02


def test_draw_seed_spreads():
    seeds = {draw_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= x < 2**63 for x in seeds)


def test_extreme_valid_knobs_give_tokens_in_the_vocabulary():
    """Found by fuzzing: a repetition penalty of 2.2e-313 (0 in float32) or a temperature of
    1e-300 used to turn logits into inf/NaN and draw an id past the vocabulary, failing the
    whole step. Now every row still draws a valid token."""
    v = 50
    logits = torch.randn(4, v)
    params = [
        SamplingParams(temperature=1.0, repetition_penalty=2.2250738585e-313, frequency_penalty=-0.9),
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=0.7, repetition_penalty=2.2250738585e-313, logit_bias={3: 100.0}),
        SamplingParams(temperature=2.0, presence_penalty=-2.0, frequency_penalty=-2.0),
    ]
    hist = [[1, 2, 3, 3], [], [3, 4], [5, 5, 5]]
    for seed in range(20):
        torch.manual_seed(seed)
        out = Sampler(v, "cpu")(logits.clone(), SampleInputs(params, hist))
        assert all(0 <= t.token_id < v for t in out), [t.token_id for t in out]
    # the temperature 1e-300 row is as good as greedy
    assert out[1].token_id == int(logits[1].argmax())


def test_a_plan_finished_with_its_bitmask_later_samples_as_sample_does():
    """Sampler.plan (before the grammar masks exist) + Sampler.finish (once they do) is the
    same computation as sample(): same tokens and logprobs, on a mixed batch of greedy,
    plain, top-k, top-p and min-p rows, penalties, a bias, bans and a partial bitmask."""
    g = torch.Generator().manual_seed(7)
    v, n = 50, 12
    logits = torch.randn(n, v, generator=g) * 3
    allowed = torch.rand(n, v, generator=g) < 0.4
    allowed[[1, 5, 9]] = True  # unconstrained rows
    allowed[4] = False
    allowed[4, [3, 7]] = True  # a grammar that only allows tokens that are banned: grammar wins
    mask = pack(allowed)
    knobs = [
        dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=1.2, top_k=5, seed=2),
        dict(temperature=0.9, top_p=0.7, seed=3), dict(temperature=1.0, min_p=0.2, seed=4),
        dict(temperature=0.7, repetition_penalty=1.3, seed=5), dict(temperature=1.0, frequency_penalty=0.5),
        dict(temperature=0.6, logit_bias={2: 5.0}, seed=6), dict(temperature=0, presence_penalty=1.0),
        dict(temperature=1.0, seed=8, logprobs=2), dict(temperature=0.5), dict(temperature=0.3, seed=9),
    ]
    params = [SamplingParams(**k) for k in knobs]
    hist = [[(3 * i + j) % v for j in range(i % 4)] for i in range(n)]
    banned = [[3, 7] if i in (4, 6) else [] for i in range(n)]
    s = sampler(v)
    torch.manual_seed(11)
    direct = s.sample(logits.clone(), SampleInputs(params, hist, banned, bitmask=mask))
    torch.manual_seed(11)
    plan = s.plan(logits.clone(), SampleInputs(params, hist, banned), masked=True)
    later = s.finish(plan, mask)
    assert later == direct
    assert all(allowed[i, t.token_id] for i, t in enumerate(direct)), "every token is one the bitmask allows"
