"""gpt-oss (GptOssForCausalLM) equals transformers (float32, CPU): greedy output token for
token, prompt logprobs within 1e-4 over a prompt several sliding windows long, whatever the
prefill chunk or page size, and from the radix cache; an MXFP4 checkpoint loads as the
weights it stands for.

The tiny model makes each piece visible: one sliding layer (16 tokens) and one full, YaRN
past its original 32 positions, sinks of magnitude ~2 (above most scores), biases on every
projection, router and expert, and a swiglu_limit (0.6) that the gate and up values pass.
Each is shown to matter: transformers with it turned off gives other logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from streamer.model.gpt_oss import FP4_E2M1, dequantize_mxfp4
from tests.conftest import make_tiny_model
from tests.model.test_greedy_vs_transformers import assert_matches, prompts, run_and_compare
from tests.oracle import _hf_model

CONFIG = dict(
    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
    layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.6, max_position_embeddings=128,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    pad_token_id=None,
)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def perturb(folder: Path) -> None:
    """Sinks, biases and norms away from their initial values (zeros and ones)."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    gen = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith("sinks"):
            tensors[name] = 2.0 * torch.randn(t.shape, generator=gen)
        elif name.endswith("bias") or "norm" in name:
            tensors[name] = t + 0.2 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("gpt-oss") / "m", "GptOssForCausalLM", default_model, **CONFIG)
    perturb(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir)) as engine:
        yield engine


def test_greedy_matches_transformers(model_dir, llm):
    batch = prompts(llm.tokenizer, 3, 20, 90, seed=1)
    assert_matches(run_and_compare(llm, model_dir, batch, GREEDY), 3)


def logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_prompt_logprobs_match_transformers_and_each_piece_matters(model_dir, llm):
    (ids,) = prompts(llm.tokenizer, 1, 110, 110, seed=4)
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1))
    assert out.error is None, out.error
    hf = _hf_model(str(model_dir))
    want = logprobs(hf, ids)
    ours = torch.tensor(out.prompt_logprobs)
    assert ours.shape == want.shape
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()

    from transformers import AutoModelForCausalLM

    def without(sinks: bool = True, **flip) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **flip).eval()
        if not sinks:
            for layer in model.model.layers:
                layer.self_attn.sinks.data.fill_(-1e9)
        return logprobs(model, ids)

    for flipped in (without(sliding_window=4096), without(swiglu_limit=1e6), without(sinks=False),
                    without(rope_parameters={**CONFIG["rope_parameters"], "rope_type": "default"})):
        assert (flipped - want).abs().max() > 1e-2


@pytest.mark.parametrize("chunk,page_size", [(7, 1), (64, 16)])
def test_chunk_and_page_size_do_not_change_output(model_dir, chunk, page_size):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(model_dir), max_num_batched_tokens=chunk, page_size=page_size) as engine:
        batch = prompts(engine.tokenizer, 3, 20, 90, seed=2)
        alone = [engine.generate([p], params)[0].token_ids for p in batch]
        together = [o.token_ids for o in engine.generate(batch, params)]
        assert alone == together
        assert_matches(run_and_compare(engine, model_dir, batch, params), 3)


def test_cached_prefix_gives_the_same_output(model_dir, llm):
    (ids,) = prompts(llm.tokenizer, 1, 90, 90, seed=5)
    first, second = (llm.generate([ids], GREEDY)[0] for _ in range(2))
    assert second.cached_tokens >= 64, "the second run takes the prompt's pages from the radix cache"
    assert second.token_ids == first.token_ids


def test_mxfp4_dequantization_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 2), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert ours.shape == (3, 10, 64)
    # (transformers' returns the [E, in, out] of its parameter)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2))
    assert set(ours.unique().abs().tolist()) <= {abs(v) * 2.0**e for v in FP4_E2M1 for e in range(-7, 7)}


def mxfp4_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """dst: src's model with MXFP4 experts (random codes, scales near 1), as the released
    checkpoints store them; returns the unquantized tensors the blocks stand for."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    plain = dict(tensors)
    gen = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # [E, in, out]
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 126, (e, n, k // 32), generator=gen, dtype=torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return plain


def test_an_mxfp4_checkpoint_runs_as_the_weights_it_stands_for(model_dir, tmp_path):
    from safetensors.torch import save_file

    plain = mxfp4_checkpoint(model_dir, tmp_path / "mxfp4")
    # the same model unquantized: transformers' dequantization of the blocks, saved as bf16 would be
    dense = tmp_path / "dense"
    dense.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (dense / f.name).write_bytes(f.read_bytes())
    save_file(plain, str(dense / "model.safetensors"), metadata={"format": "pt"})
    with LLM(str(tmp_path / "mxfp4"), quantization="mxfp4") as quantized:  # (its format's name: a check)
        batch = prompts(quantized.tokenizer, 2, 20, 60, seed=6)
        got = [o.token_ids for o in quantized.generate(batch, GREEDY)]
    with LLM(str(dense)) as engine:
        assert [o.token_ids for o in engine.generate(batch, GREEDY)] == got
        assert_matches(run_and_compare(engine, dense, batch, GREEDY), 2)


def test_mxfp4_parts_are_refused_where_they_do_not_belong(model_dir, tmp_path):
    q = tmp_path / "q"
    mxfp4_checkpoint(model_dir, q)
    cfg = json.loads((q / "config.json").read_text())
    del cfg["quantization_config"]
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="MXFP4"):
        LLM(str(q))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "group_size": 32}
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="group_size"):
        LLM(str(q))
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantization='fp8'"):
        LLM(str(q), quantization="fp8")
