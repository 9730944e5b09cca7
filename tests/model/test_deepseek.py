"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, their routers and shared
experts) equal transformers (float32, CPU): greedy output token for token, batched, with
chunked prefill, page size 1 and 16 and from the radix cache; prompt logprobs within 1e-4.
The KV pool holds the latent (kv_lora_rank + qk_rope_head_dim values per token and layer),
also through the host tier; kernels/mla.py equals the expanded attention it stands for; a
block-scaled float8 checkpoint (DeepSeek-V3's layout) runs with kv_b_proj dequantized.

The tiny models make each piece visible: V2 without q_lora_rank and with
group_limited_greedy routing; V3 with q_lora_rank, noaux_tc routing (a perturbed
e_score_correction_bias), a dense first layer, shared experts, attention biases and YaRN
rope with mscale_all_dim (the softmax scale). Norms and biases are moved off their initial
values; the pieces are shown to matter by flipping them in transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.mla import paged_mla, store_latent
from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from tests.conftest import make_tiny_model
from tests.model.test_greedy_vs_transformers import assert_matches, prompts, run_and_compare
from tests.oracle import _hf_model

MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           max_position_embeddings=128, pad_token_id=None)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
CONFIGS = {
    "DeepseekV2ForCausalLM": dict(MLA, q_lora_rank=None, num_hidden_layers=2, first_k_dense_replace=0,
                                  num_experts_per_tok=3,  # (more than topk_group: the group limit can bind)
                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=2.0),
    "DeepseekV3ForCausalLM": dict(MLA, q_lora_rank=24, num_hidden_layers=3, first_k_dense_replace=1, n_group=4,
                                  topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                  attention_bias=True, rope_parameters=YARN),
}
ARCHS = list(CONFIGS)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def perturb(folder: Path) -> None:
    """Norms, biases and the router's correction bias away from their initial values."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    gen = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = 0.3 * torch.randn(t.shape, generator=gen)
        elif name.endswith("bias") or "norm" in name:
            tensors[name] = t + 0.2 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for arch, cfg in CONFIGS.items():
        out[arch] = make_tiny_model(root / arch, arch, default_model, **cfg)
        perturb(out[arch])
    return out


@pytest.fixture(scope="module")
def engines(models):
    made: dict[str, LLM] = {}

    def get(arch: str) -> LLM:
        if arch not in made:
            made[arch] = LLM(str(models[arch]))
        return made[arch]

    yield get
    for engine in made.values():
        engine.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(models, engines, arch):
    llm = engines(arch)
    batch = prompts(llm.tokenizer, 3, 10, 80, seed=1)
    assert_matches(run_and_compare(llm, models[arch], batch, GREEDY), 3)


def logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_transformers_and_each_piece_matters(models, engines, arch):
    llm = engines(arch)
    (ids,) = prompts(llm.tokenizer, 1, 100, 100, seed=4)  # (past YaRN's original 32 positions)
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1))
    assert out.error is None, out.error
    want = logprobs(_hf_model(str(models[arch])), ids)
    ours = torch.tensor(out.prompt_logprobs)
    assert ours.shape == want.shape
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()

    from transformers import AutoModelForCausalLM

    def flipped(shared: bool = True, **kw) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(str(models[arch]), dtype=torch.float32, **kw).eval()
        if not shared:
            for layer in model.model.layers:
                if hasattr(layer.mlp, "shared_experts"):
                    layer.mlp.shared_experts.down_proj.weight.data.zero_()
        return logprobs(model, ids)

    flips: list[dict] = [dict(routed_scaling_factor=1.0), dict(shared=False)]
    if arch == "DeepseekV2ForCausalLM":
        flips.append(dict(topk_method="greedy"))
    else:
        flips += [dict(rope_parameters={**YARN, "mscale_all_dim": 0.0}), dict(rope_interleave=False),
                  dict(topk_group=4), dict(norm_topk_prob=False)]
    for kw in flips:
        assert (flipped(**kw) - want).abs().max() > 1e-2, kw


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk,page_size", [(7, 1), (64, 16)])
def test_chunk_and_page_size_do_not_change_output(models, arch, chunk, page_size):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(models[arch]), max_num_batched_tokens=chunk, page_size=page_size) as engine:
        batch = prompts(engine.tokenizer, 3, 10, 70, seed=2)
        alone = [engine.generate([p], params)[0].token_ids for p in batch]
        together = [o.token_ids for o in engine.generate(batch, params)]
        assert alone == together
        assert_matches(run_and_compare(engine, models[arch], batch, params), 3)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefix_gives_the_same_output(models, engines, arch):
    llm = engines(arch)
    (ids,) = prompts(llm.tokenizer, 1, 90, 90, seed=5)
    first, second = (llm.generate([ids], GREEDY)[0] for _ in range(2))
    assert second.cached_tokens >= 64, "the second run takes the prompt's pages from the radix cache"
    assert second.token_ids == first.token_ids
    assert_matches(run_and_compare(llm, models[arch], [ids], GREEDY), 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_pool_holds_the_latent(models, engines, arch):
    cfg = CONFIGS[arch]
    pool = engines(arch).engine.runner.pool
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    layers, pages, page_size = cfg["num_hidden_layers"], pool.num_pages, pool.page_size
    assert tuple(pool.k.shape) == (layers, pages, page_size, 1, latent)
    assert pool.v.data_ptr() == pool.k.data_ptr() and pool.v.shape[-1] == cfg["kv_lora_rank"]  # V is in K
    assert pool.v_bytes.numel() == 0
    per_token_layer = pool.k_bytes.shape[2] // page_size // pool.k.element_size()
    assert per_token_layer == latent  # 40 values, not 2 x heads x head dims (4 x (24 + 12) = 144)


def test_the_host_tier_round_trips_latent_pages(models):
    from streamer.kv.host import HostTier

    with LLM(str(models["DeepseekV3ForCausalLM"]), page_size=4) as engine:
        pool = engine.engine.runner.pool
        tier = HostTier(pool, 1 << 20)
        assert tier.host.page_bytes == pool.k_bytes.shape[0] * pool.k_bytes.shape[2]  # K alone
        pool.k[:, 1:3].normal_()
        before = pool.k[:, 1:3].clone()
        tier.write([1, 2], [0, 1])
        pool.k[:, 1:3].zero_()
        tier.load([0, 1], [2, 1])
        assert torch.equal(pool.k[:, 2], before[:, 0]) and torch.equal(pool.k[:, 1], before[:, 1])


def test_sessions_outgrowing_the_pool_keep_their_prefixes_in_the_host_tier(models):
    """Latent pages written back to the host and loaded again give the same greedy output."""
    path = str(models["DeepseekV3ForCausalLM"])
    sessions, turns, new, page_size = 6, 4, 10, 4
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    def chat(llm: LLM) -> tuple[list[list[int]], int]:
        gen = torch.Generator().manual_seed(0)
        history = {i: torch.randint(10, 40000, (5,), generator=gen).tolist() for i in range(sessions)}
        outs, host = [], 0
        for _ in range(turns):
            for i in range(sessions):
                p = history[i] + torch.randint(10, 40000, (new,), generator=gen).tolist()
                (o,) = llm.generate([p], params)
                outs.append(o.token_ids)
                host += o.cached_host_tokens
                history[i] = p + o.token_ids
        llm.check()
        return outs, host

    working = sessions * ((5 + turns * (new + 3)) // page_size + 1)
    with LLM(path, page_size=page_size, num_pages=4 * working) as big:
        want, _ = chat(big)
    with LLM(path, page_size=page_size, num_pages=working // 3, max_num_seqs=2, host_kv_cache_gb=0.01) as tiered:
        got, host = chat(tiered)
        s = tiered.stats()
    assert got == want
    assert host > 0 and s.host is not None and s.host.write_backs > 0 and s.host.load_backs > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_float8_latent_cache_computes_what_a_rounded_latent_does(models, arch, monkeypatch):
    """kv_cache_dtype "fp8": the pool holds the latent in float8 e4m3 (rounded, saturated at
    +-448), so the answers are those of the full-precision pool holding the rounded latent
    (store_latent rounding it first): the same greedy tokens and prompt logprobs. The
    rounding is not nothing: the unrounded pool's logprobs differ."""
    import streamer.model.deepseek as ds

    prompts = [[5, 17, 99, 5, 17, 300, 41] * 3, list(range(100, 160))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs_from=1)

    def answers(**kw):
        with LLM(str(models[arch]), page_size=4, max_num_batched_tokens=32, **kw) as llm:
            if kw:
                assert llm.engine.runner.pool.k.dtype == torch.float8_e4m3fn
            return [(o.token_ids, o.prompt_logprobs) for o in llm.generate(prompts, params)]

    fp8 = answers(kv_cache_dtype="fp8")
    exact = answers()
    store = ds.store_latent
    monkeypatch.setattr(ds, "store_latent", lambda latent, cache, slots: store(
        latent.clamp(-448, 448).to(torch.float8_e4m3fn).to(latent.dtype), cache, slots))
    rounded = answers()
    for (t8, l8), (tr, lr) in zip(fp8, rounded, strict=True):
        assert t8 == tr
        assert max(abs(a - b) for a, b in zip(l8, lr)) < 1e-5
    assert max(abs(a - b) for (_, l8), (_, le) in zip(fp8, exact) for a, b in zip(l8, le)) > 1e-4


def test_unsupported_settings_are_refused_by_name(models, tmp_path):
    v2, v3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    cases = [(v2, "norm_topk_prob", True), (v2, "topk_method", "noaux_tc"), (v3, "topk_method", "greedy"),
             (v2, "moe_layer_freq", 2), (v2, "num_key_value_heads", 2), (v2, "scoring_func", "sigmoid"),
             (v3, "scoring_func", "softmax"), (v3, "head_dim", 16), (v3, "quantization_config", fp8)]
    for i, (arch, field, value) in enumerate(cases):
        bad = tmp_path / str(i)
        bad.mkdir()
        for f in models[arch].iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((bad / "config.json").read_text())
        cfg[field] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=field):
            LLM(str(bad))


EXPERTS = r"model\.layers\.\d+\.mlp\.experts"
KV_B = r"model\.layers\.\d+\.self_attn\.kv_b_proj"


def block_fp8_checkpoint(src: Path, dst: Path, dense: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """dst: src's model with its projections float8 in [16, 16] blocks (weight_scale_inv, as
    DeepSeek-V3's checkpoints store them), except those matching a pattern of `dense`
    (modules_to_not_convert), stored as the values their blocks would stand for. Returns
    every tensor as the values it stands for."""
    import re

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    out, plain = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not name.endswith(("_proj.weight", "_mqa.weight")):
            out[name] = plain[name] = w
            continue
        blocks = w.unflatten(0, (-1, 16)).unflatten(2, (-1, 16))  # [N/16, 16, K/16, 16]
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        plain[name] = (q.float() * scale[:, None, :, None]).flatten(2).flatten(0, 1)
        if any(re.match(p, name) for p in dense):
            out[name] = plain[name]
        else:
            out[name], out[name + "_scale_inv"] = q.flatten(2).flatten(0, 1), scale
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [16, 16], "modules_to_not_convert": list(dense)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return plain


def round_groups_16(x: torch.Tensor) -> torch.Tensor:
    """What block_fp8_linear makes of its input: float8 per token and group of 16 columns."""
    from streamer.model import quant

    flat = x.reshape(-1, x.shape[-1])
    q, s = quant.quantize_groups_fp8(flat, 16)
    return (q.float() * s.repeat_interleave(16, 1)).view(x.shape)


def test_a_block_fp8_checkpoint_dequantizes_kv_b_proj_and_runs_the_rest_as_stored(default_model, tmp_path):
    """DeepSeek-V3's float8 layout: kv_b_proj is dequantized at load, to exactly the values a
    checkpoint storing it dense gives; the other projections stay float8 and compute what
    transformers computes with their inputs rounded to float8 (all but kv_b_proj's: the
    compressed kv stays as it is). (The routed experts are kept dense here: transformers'
    experts are no Linear layers to round the inputs of; their float8 path is moe.py's.)"""
    from safetensors.torch import save_file

    cfg = dict(CONFIGS["DeepseekV3ForCausalLM"], qk_rope_head_dim=16, head_dim=16, q_lora_rank=32)  # (16s)
    src = make_tiny_model(tmp_path / "src", "DeepseekV3ForCausalLM", default_model, **cfg)
    plain = block_fp8_checkpoint(src, tmp_path / "fp8", (EXPERTS,))
    block_fp8_checkpoint(src, tmp_path / "dense_kv_b", (EXPERTS, KV_B))
    (ids,) = prompts(AutoTokenizer(default_model), 1, 60, 60, seed=7)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1)
    with LLM(str(tmp_path / "fp8")) as engine:
        attn = engine.engine.runner.model.layers[1].self_attn
        assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn and attn.q_a_proj.block == (16, 16)
        assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.kv_b_proj.weight_scale is None
        assert torch.equal(attn.kv_b_proj.weight, plain["model.layers.1.self_attn.kv_b_proj.weight"])
        (a,) = engine.generate([ids], params)
    with LLM(str(tmp_path / "dense_kv_b")) as engine:
        (b,) = engine.generate([ids], params)
    assert a.error is None and b.error is None
    assert a.prompt_logprobs == b.prompt_logprobs

    dense = tmp_path / "dense"
    dense.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dense / f.name).write_bytes(f.read_bytes())
    save_file(plain, str(dense / "model.safetensors"), metadata={"format": "pt"})
    hf = _hf_model(str(dense))
    for name, m in hf.named_modules():
        if isinstance(m, torch.nn.Linear) and not name.endswith(("lm_head", "kv_b_proj")):
            m.register_forward_pre_hook(lambda mod, args: (round_groups_16(args[0]),))
    diff = (torch.tensor(a.prompt_logprobs) - logprobs(hf, ids)).abs()
    # (2e-6 here; a last-bit difference that moved an input across a float8 rounding boundary
    # would move a logprob further: tests/model/test_fp8_checkpoint.py)
    assert diff.max() < 1e-3, diff


def AutoTokenizer(path: Path):  # noqa: N802 - (transformers' loader, imported late)
    from transformers import AutoTokenizer as tok

    return tok.from_pretrained(str(path))


def naive_mla(q_nope, q_rope, c, k_rope, w_uk, w_uv, scale, q_pos, k_pos):
    """One sequence's attention as transformers computes it: keys and values decompressed
    per head (k = [W_UK c, k_rope], v = W_UV c), causal over positions."""
    k_nope = torch.einsum("hnr,lr->lhn", w_uk, c)
    v = torch.einsum("hvr,lr->lhv", w_uv, c)
    k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, k_nope.shape[1], -1)), dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1)
    scores = torch.einsum("thd,lhd->htl", q.double(), k.double()) * scale
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("htl,lhv->thv", scores.softmax(-1), v.double())


@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_mla_equals_the_expanded_attention(page_size):
    """A mixed batch (two decodes, a prefill chunk after a cached prefix, a whole prompt) in
    shuffled pages: the absorbed latent attention equals the decompressed one."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, rank, v_dim, scale = 3, 8, 4, 16, 6, 0.3
    w_uk = torch.randn(heads, nope, rank, generator=gen)
    w_uv = torch.randn(heads, v_dim, rank, generator=gen)
    lens, q_lens = [9, 5, 13, 7], [1, 1, 6, 7]
    pages_of = [-(-n // page_size) for n in lens]
    perm = (torch.randperm(sum(pages_of), generator=gen) + 1).tolist()
    page_table = torch.zeros(len(lens), max(pages_of), dtype=torch.int32)
    cache = torch.full((sum(pages_of) + 1, page_size, 1, rank + rope), float("nan"))
    qs, want = [], []
    for b, (n, ql) in enumerate(zip(lens, q_lens)):
        page_table[b, : pages_of[b]] = torch.tensor(perm[: pages_of[b]])
        perm = perm[pages_of[b]:]
        c, k_rope = torch.randn(n, rank, generator=gen), torch.randn(n, rope, generator=gen)
        slots = torch.tensor([int(page_table[b, i // page_size]) * page_size + i % page_size for i in range(n)])
        store_latent(torch.cat((c, k_rope), -1)[:, None], cache, slots)
        q_nope, q_rope = torch.randn(ql, heads, nope, generator=gen), torch.randn(ql, heads, rope, generator=gen)
        qs.append(torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope), -1))
        want.append(naive_mla(q_nope, q_rope, c, k_rope, w_uk, w_uv, scale, torch.arange(n - ql, n), torch.arange(n)))
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = paged_mla(torch.cat(qs), cache, page_table, torch.tensor(lens, dtype=torch.int32), cu, scale, rank)
    got = torch.einsum("thr,hvr->thv", out.double(), w_uv.double())
    assert torch.allclose(got, torch.cat(want), atol=1e-4, rtol=1e-4), (got - torch.cat(want)).abs().max()
    # a padding slot (-1) writes nothing
    before = cache.clone()
    store_latent(torch.ones(1, 1, rank + rope), cache, torch.tensor([-1]))
    assert torch.equal(cache.nan_to_num(), before.nan_to_num())


def test_per_channel_float8_scales_follow_the_rope_reordering(default_model, tmp_path):
    """The loader reorders each q head's rope rows and k_rope's rows from interleaved pairs:
    a per-row float8 scale must move with its row. A row's float8 values and scale do not
    depend on where it sits, so a per-channel checkpoint's q and kv_a layers equal online
    quantization's (which quantizes after the reordering), bit for bit."""
    from streamer.model.loader import load_model
    from tests.model.test_fp8_checkpoint import ct_config, per_row, write_checkpoint

    cfg = dict(CONFIGS["DeepseekV2ForCausalLM"], qk_rope_head_dim=16, head_dim=16)  # (float8 GEMMs: 16s)
    src = make_tiny_model(tmp_path / "src", "DeepseekV2ForCausalLM", default_model, **cfg)
    qc = ct_config({"strategy": "channel"}, {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                             "symmetric": True}, ignore=("lm_head", "re:.*experts.*", "re:.*mlp\\.gate$"))
    path = write_checkpoint(src, tmp_path / "ct", qc, per_row, "weight_scale",
                            keep=("lm_head", "embed_tokens", "experts", "mlp.gate."))
    ours, _ = load_model(path)
    online, _ = load_model(src, quantization="fp8")
    for i in range(2):
        for name in ("q_proj", "kv_a_proj_with_mqa"):
            a, b = (getattr(m.layers[i].self_attn, name) for m in (ours, online))
            assert a.weight.dtype == torch.float8_e4m3fn and a.weight_scale.numel() == a.out_features
            assert torch.equal(a.weight.float(), b.weight.float()), name
            assert torch.equal(a.weight_scale, b.weight_scale), name


def test_dummy_weights_of_a_float8_config_give_a_dense_kv_b_proj(default_model, tmp_path):
    """kv_b_proj is dequantized once the weights are in, from a checkpoint or dummy values
    (benchmarks run float8 DeepSeek shapes with dummy weights)."""
    from streamer.model.loader import load_model

    cfg = dict(CONFIGS["DeepseekV3ForCausalLM"], qk_rope_head_dim=16, head_dim=16, q_lora_rank=32)  # (16s)
    src = make_tiny_model(tmp_path / "src", "DeepseekV3ForCausalLM", default_model, **cfg)
    block_fp8_checkpoint(src, tmp_path / "fp8", (EXPERTS,))
    model, _ = load_model(tmp_path / "fp8", load_format="dummy")
    attn = model.layers[1].self_attn
    assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.kv_b_proj.weight_scale is None
    with LLM(str(tmp_path / "fp8"), load_format="dummy") as engine:
        (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out.error is None and len(out.token_ids) == 3
