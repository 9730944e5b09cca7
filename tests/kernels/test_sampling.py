"""kernels.sampling.draw (bitmask + temperature + min-p + inverse-CDF draw in one kernel)
== kernels.reference.masked_draw, the torch version of the engine's sampling path.

On CPU through the Triton interpreter (see conftest.py), compiled on a GPU; the `cuda`
test adds the 128k vocabulary and batch of the grammar benchmark.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.sampling import BLOCK, draw
from tests.kernels.device import DEVICE, cuda


def _case(n, v, seed, *, width=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    w = width if width is not None else (v + 31) // 32
    words = torch.randint(-(2**31), 2**31 - 1, (n + 1, w), generator=g, dtype=torch.int64).to(torch.int32)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.05, 2.0][:n], dtype=torch.float64).repeat(n)[:n]
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3][:n], dtype=torch.float64).repeat(n)[:n]
    constrained = (torch.arange(n) % 2 == 0).double()
    params = torch.stack([u, temp, min_p, constrained])
    return logits.to(DEVICE), words.to(DEVICE), params.to(DEVICE)


@pytest.mark.parametrize("v", [5000, 777], ids=["5000", "777"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block", [256, BLOCK], ids=["many_blocks", "one_block"])
def test_draw_matches_reference(v, seed, block):
    logits, words, params = _case(6, v, seed)
    for w, mp in ((words, True), (None, True), (words, False)):
        p = params.clone()
        if not mp:
            p[2] = 0
        got = draw(logits, w, p, min_p=mp, block=block)
        assert got.dtype == torch.int64 and got.shape == (6,)
        assert got.tolist() == reference.masked_draw(logits, w, p).tolist()


def test_draw_respects_mask_min_p_and_greedy():
    logits, words, params = _case(6, 3000, 5)
    params[0] = torch.linspace(0.01, 0.99, 6, dtype=torch.float64)
    got = draw(logits, words, params, min_p=True).cpu()
    lg, wd, pr = logits.cpu().float(), words.cpu(), params.cpu()
    for r, t in enumerate(got.tolist()):
        if pr[3, r]:
            assert (int(wd[r, t // 32]) >> (t % 32)) & 1, "a constrained row drew a disallowed token"
        if pr[1, r] == 0:
            assert t == int(lg[r].argmax()) or pr[3, r], "greedy rows take the argmax"
        elif pr[2, r] > 0:
            allowed = lg[r] if not pr[3, r] else lg[r].masked_fill(
                ((wd[r, torch.arange(3000) // 32] >> (torch.arange(3000) % 32)) & 1) == 0, float("-inf")
            )
            ratio = torch.exp((allowed[t] - allowed.max()) / pr[1, r].float())
            assert ratio >= pr[2, r] - 1e-6, "min-p: below min_p times the top probability"


def test_draw_frequencies_follow_softmax():
    """Uniforms on a grid: each token is drawn in proportion to its probability."""
    v, n = 40, 400
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(3)).repeat(n, 1).to(DEVICE)
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    params = torch.stack([u, torch.full((n,), 0.8, dtype=torch.float64), torch.zeros(n, dtype=torch.float64),
                          torch.zeros(n, dtype=torch.float64)]).to(DEVICE)
    counts = torch.bincount(draw(logits, None, params, min_p=False, block=16).cpu(), minlength=v).double() / n
    probs = torch.softmax(logits[0].cpu().double() / 0.8, -1)
    assert (counts - probs).abs().max() <= 1.0 / n + 1e-9


def test_draw_edges_mask_width_bf16_and_dead_rows():
    """A mask narrower than the vocabulary disallows the tail on constrained rows only; bf16
    logits; a row with nothing allowed still returns a valid id; empty batch."""
    logits, words, params = _case(4, 1000, 7, width=20, dtype=torch.bfloat16)  # 640 < 1000 tokens
    params[1] = 1.0
    got = draw(logits, words, params, min_p=True, block=128)
    assert got.tolist() == reference.masked_draw(logits, words, params).tolist()
    assert all(t < 640 for t in got[::2].tolist())
    words[1].zero_()
    params[3, 1] = 1.0
    dead = draw(logits, words, params, min_p=False)[1].item()
    assert 0 <= dead < 1000
    assert draw(logits[:0], None, params[:, :0], min_p=False).shape == (0,)


@pytest.mark.cuda
@cuda
def test_cuda_draw_large_vocab_batch():
    logits, words, params = _case(64, 128256, 11)
    got = draw(logits, words, params, min_p=True)
    ref = reference.masked_draw(logits, words, params)
    # equal except where u * total falls within float32 rounding of a boundary
    assert (got == ref).float().mean().item() >= 0.95


def test_sampler_draws_with_the_kernel_where_it_can_with_the_same_tokens():
    """streamer.sampling.Sampler with its kernel path on (the default on CUDA) gives the tokens
    of its torch path: greedy, plain, seeded and min-p rows, a bias and a penalty, grammar rows
    with their bitmask. A top-k row, a ban or logprobs send the batch to the torch path."""
    from streamer.messages import GrammarSpec, SamplingParams
    from streamer.sampling.sampler import SampleInputs, Sampler

    g = torch.Generator().manual_seed(3)
    v, n = 3000, 8
    logits = (torch.randn(n, v, generator=g) * 2).to(DEVICE)
    allowed = torch.rand(n, v, generator=g) < 0.3
    json = GrammarSpec("json_object")
    knobs = [
        dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=1.0, min_p=0.2, seed=4),
        dict(temperature=0.7, repetition_penalty=1.3), dict(temperature=0.6, logit_bias={2: 5.0}, seed=6),
        dict(temperature=0.9, grammar=json), dict(temperature=0, grammar=json), dict(temperature=1.1, seed=3, grammar=json),
    ]
    params = [SamplingParams(**k) for k in knobs]
    for i, p in enumerate(params):
        if p.grammar is None:
            allowed[i] = True
    bits = torch.zeros(n, (v + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    words = (bits.view(n, -1, 32) << torch.arange(32)).sum(-1)
    mask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    hist = [[(5 * i + j) % v for j in range(i % 3)] for i in range(n)]

    def run(kernel: bool, ps=params, banned=None):
        s = Sampler(v, DEVICE)
        s.one_kernel = kernel
        torch.manual_seed(11)
        plan = s.plan(logits.clone(), SampleInputs(ps, hist, banned or []), masked=True)
        return (plan.draw.kernel is not None), s.finish(plan, mask)

    used, got = run(True)
    assert used and isinstance(got, torch.Tensor)
    assert got.tolist() == run(False)[1].tolist()
    assert all(allowed[i, t] for i, t in enumerate(got.tolist()))
    assert not run(True, params[:-1] + [SamplingParams(temperature=1.0, top_k=5)])[0]
    assert not run(True, banned=[[1]] + [[]] * (n - 1))[0]
    assert not run(True, params[:-1] + [SamplingParams(temperature=1.0, logprobs=1)])[0]
