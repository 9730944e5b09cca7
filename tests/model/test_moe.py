"""Mixtral and Qwen3-MoE equal transformers (float32, CPU): greedy output token for token
in a batch, whatever the prefill chunk or page size, and prompt logprobs within 1e-4.

The tiny models: a Mixtral of 4 experts (top 2) with a 16-token window under prompts of
up to 100; a Qwen3-MoE of 8 experts (top 2) with norm_topk_prob and a dense layer 0
(mlp_only_layers); one without norm_topk_prob whose dense layer comes from
decoder_sparse_step 2; a Qwen2-MoE with a gated shared expert in every layer, q/k/v
biases and a 16-token window on layer 0 (max_window_layers 1); a GLM-4.5 of 2 groups of 4
experts with its router's correction bias, q/k norms and half-rotary heads; an OLMoE with
whole-projection q/k norms and clip_qkv; a Granite MoE with its four scalars. Broken checkpoints and unsupported configs are refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from streamer.model.loader import load_model
from tests.conftest import make_tiny_model
from tests.model.test_greedy_vs_transformers import assert_matches, prompts, run_and_compare
from tests.oracle import Comparison, _hf_model, compare

ARCHS = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen3_moe_step": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   norm_topk_prob=False, decoder_sparse_step=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, norm_topk_prob=False,
                                              use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    # 2 groups of 4 experts, one kept; a dense layer 0; q/k norms with half-rotary heads
    "glm4_moe": ("Glm4MoeForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                            norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True,
                                            attention_bias=True, partial_rotary_factor=0.5, pad_token_id=None)),
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=0.5,
                                       pad_token_id=None)),
    "granite_moe": ("GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                                                  residual_multiplier=0.22, attention_multiplier=0.015625,
                                                  logits_scaling=8.0)),
}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, default_model) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    out = {name: make_tiny_model(root / name, arch, default_model, **kw) for name, (arch, kw) in ARCHS.items()}
    perturb_router_bias(out["glm4_moe"])
    return out


def perturb_router_bias(folder: Path) -> None:
    """transformers initialises GLM's e_score_correction_bias to 0 and its q/k norms to 1;
    give them values (the bias of the scores' size, so that it moves the choice as a
    trained one does; norms whose dims differ, so that their order under partial rotary
    is tested)."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(11)
        for name in [n for n in t if n.endswith(("e_score_correction_bias", "q_norm.weight", "k_norm.weight"))]:
            t[name] = t[name] + 0.3 * torch.randn(t[name].shape, generator=gen)

    _rewrite(folder, edit)


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_batch_matches_transformers(moe_models, name):
    with LLM(str(moe_models[name])) as llm:
        batch = prompts(llm.tokenizer, 3, 20, 90, seed=1)
        assert_matches(run_and_compare(llm, moe_models[name], batch, GREEDY), 3)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_chunk_and_page_size_do_not_change_output(moe_models, name):
    path = moe_models[name]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(path), max_num_batched_tokens=7, page_size=1) as llm:
        batch = prompts(llm.tokenizer, 3, 20, 60, seed=2)
        alone = [llm.generate([p], params)[0].token_ids for p in batch]
        together = [o.token_ids for o in llm.generate(batch, params)]
        assert alone == together
        assert_matches(run_and_compare(llm, path, batch, params), 3)


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.mark.parametrize("name,flip", [("mixtral", "sliding_window"), ("qwen3_moe", "norm_topk_prob"),
                                       ("qwen3_moe_step", "norm_topk_prob"), ("qwen2_moe", "sliding_window"),
                                       ("glm4_moe", "routed_scaling_factor"), ("glm4_moe", "topk_group"),
                                       ("granite_moe", "residual_multiplier")])
def test_prompt_logprobs_match_transformers(moe_models, name, flip):
    """Every position's logprob within 1e-4 of transformers'; the same weights with the
    window or the renormalization flipped are further off (so each is tested)."""
    from transformers import AutoModelForCausalLM

    path = moe_models[name]
    with LLM(str(path)) as llm:
        (ids,) = prompts(llm.tokenizer, 1, 100, 100, seed=4)
        (out,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1))
    assert out.error is None, out.error
    want = _hf_logprobs(_hf_model(str(path)), ids)
    ours = torch.tensor(out.prompt_logprobs)
    assert ours.shape == want.shape
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    value = {"sliding_window": 4096, "routed_scaling_factor": 1.0, "topk_group": 2, "residual_multiplier": 1.0}.get(
        flip, not ARCHS[name][1].get(flip))
    other = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **{flip: value}).eval()
    assert (_hf_logprobs(other, ids) - want).abs().max() > 1e-3


def _rewrite(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name,tensor", [
    ("mixtral", "layers.1.block_sparse_moe.experts.2.w3.weight"),
    ("qwen3_moe", "layers.1.mlp.experts.7.down_proj.weight"),
    ("qwen3_moe", "layers.1.mlp.gate.weight"),
    ("qwen2_moe", "layers.1.mlp.shared_expert_gate.weight"),
    ("qwen2_moe", "layers.0.mlp.shared_expert.up_proj.weight"),
])
def test_missing_expert_tensor_is_refused_by_name(moe_models, tmp_path, name, tensor):
    folder = _copy(moe_models[name], tmp_path / name)
    _rewrite(folder, lambda t: t.pop(f"model.{tensor}"))
    with pytest.raises(ModelLoadError, match=f"missing tensor.*{tensor}"):
        load_model(folder)


def test_misshapen_expert_tensor_is_refused_by_name(moe_models, tmp_path):
    folder = _copy(moe_models["mixtral"], tmp_path / "mixtral")
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    _rewrite(folder, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(ModelLoadError, match=f"{name}.*shape"):
        load_model(folder)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_fused_expert_tensors_load_as_the_per_expert_ones(moe_models, tmp_path, name):
    """transformers 5.24's own module names (mlp.experts.gate_up_proj [E, 2I, H],
    mlp.experts.down_proj [E, H, I], mlp.gate) give the same parameters."""
    arch, kw = ARCHS[name]
    experts = kw.get("num_local_experts") or kw["num_experts"]
    legacy = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}.get(name, ("mlp", "gate_proj", "up_proj", "down_proj"))
    block, g, u, d = legacy

    def fuse(t: dict[str, torch.Tensor]) -> None:
        p = "model.layers.1"
        e = [f"{p}.{block}.experts.{i}" for i in range(experts)]
        t[f"{p}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([t.pop(f"{x}.{g}.weight"), t.pop(f"{x}.{u}.weight")]) for x in e])
        t[f"{p}.mlp.experts.down_proj"] = torch.stack([t.pop(f"{x}.{d}.weight") for x in e])
        t[f"{p}.mlp.gate.weight"] = t.pop(f"{p}.{block}.gate.weight")

    folder = _copy(moe_models[name], tmp_path / name)
    _rewrite(folder, fuse)
    want = dict(load_model(moe_models[name])[0].named_parameters())
    got = dict(load_model(folder)[0].named_parameters())
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert not torch.equal(got["layers.1.mlp.experts.down_proj"][0], got["layers.1.mlp.experts.down_proj"][1])


@pytest.mark.parametrize("name,edit,field", [
    ("qwen3_moe", dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok"),
    ("mixtral", dict(attention_bias=True), "attention_bias"),
    ("mixtral", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
])
def test_unsupported_config_is_refused_by_field(moe_models, tmp_path, name, edit, field):
    import json

    folder = _copy(moe_models[name], tmp_path / name)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ModelLoadError, match=field):
        load_model(folder, load_format="dummy")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_fp8_experts_follow_transformers_with_the_same_roundings(moe_models, name):
    """quantization "fp8": float8 experts (per-row scales) and linear layers, the router
    unquantized; greedy output equals transformers computing the same roundings
    (tests/oracle.py emulate_w8a8), batched and in short prefill chunks."""
    path = moe_models[name]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(path), quantization="fp8", max_num_batched_tokens=32) as llm:
        block = llm.engine.runner.model.layers[1].mlp
        assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert block.experts.down_proj_scale.shape == block.experts.down_proj.shape[:2]
        assert block.gate.weight.dtype == torch.float32
        batch = prompts(llm.tokenizer, 3, 20, 70, seed=4)
        outs = llm.generate(batch, params)
    cmp = Comparison()
    for p, o in zip(batch, outs):
        assert o.error is None, o.error
        compare(path, p, o.token_ids, cmp, w8a8=True)
    assert not cmp.failures, "\n".join(cmp.failures)
    assert cmp.exact >= len(batch) - 1, (cmp.exact, cmp.near_ties)


def test_cuda_graphs_wait_for_the_triton_kernel(moe_models, monkeypatch):
    """The reference fused_moe synchronizes (no graph capture): graphs only with kernels/moe.py."""
    import importlib.util

    model, _ = load_model(moe_models["mixtral"], load_format="dummy")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "kernels.moe" else real(n, *a))
    assert not model.cuda_graphs_ok
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "kernels.moe" else real(n, *a))
    assert model.cuda_graphs_ok


def test_glms_multi_token_prediction_layer_is_skipped_as_transformers_does(moe_models, tmp_path):
    """GLM-4.5 checkpoints carry num_nextn_predict_layers layers past num_hidden_layers
    (model.layers.N...), which transformers' Glm4MoeForCausalLM ignores; elsewhere a tensor
    of a layer the config lacks is refused."""
    def add_layer(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.2.self_attn.q_proj.weight"] = t["model.layers.1.self_attn.q_proj.weight"].clone()
        t["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)

    glm = _copy(moe_models["glm4_moe"], tmp_path / "glm")
    _rewrite(glm, add_layer)
    want = dict(load_model(moe_models["glm4_moe"])[0].named_parameters())
    got = dict(load_model(glm)[0].named_parameters())
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    qwen = _copy(moe_models["qwen3_moe"], tmp_path / "qwen")
    _rewrite(qwen, add_layer)
    with pytest.raises(ModelLoadError, match="layers.2"):
        load_model(qwen)


def test_granite_moe_loads_transformers_5_24s_own_names_as_its_checkpoints(moe_models, tmp_path):
    """Granite MoE checkpoints stack the experts as block_sparse_moe.input_linear / output_linear
    with router.layer; transformers 5.24 names them experts.gate_up_proj / down_proj and
    router.weight: both give the same parameters."""
    def rename(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if ".block_sparse_moe." in n]:
            new = (name.replace("input_linear.weight", "experts.gate_up_proj")
                   .replace("output_linear.weight", "experts.down_proj").replace("router.layer.weight", "router.weight"))
            t[new] = t.pop(name)

    folder = _copy(moe_models["granite_moe"], tmp_path / "granite")
    _rewrite(folder, rename)
    want = dict(load_model(moe_models["granite_moe"])[0].named_parameters())
    got = dict(load_model(folder)[0].named_parameters())
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
