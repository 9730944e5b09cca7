"""quantization "fp8": float8 weights (a scale per output row) and float8 activations (a
scale per token) in the decoder's linear layers; greedy output equals transformers
computing the same roundings (tests/oracle.py emulate_w8a8)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from streamer import LLM, SamplingParams
from streamer.config import EngineConfig
from streamer.errors import ConfigError
from streamer.model import quant
from streamer.model.layers import Linear
from streamer.model.loader import load_model
from tests.conftest import make_tiny_model
from tests.oracle import Comparison, _hf_model, compare


def test_each_row_uses_the_whole_float8_range_and_rounds_to_its_nearest_value():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 48)[:, None]
    q, scale = quant.quantize_rows_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((48,), 448.0))
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 above the subnormals
    normal = (w / scale).abs() >= 2.0**-6
    assert ((back - w).abs() <= 2.0**-4 * w.abs() + 1e-12)[normal].all()
    assert ((back - w).abs() <= 2.0**-10 * scale + 1e-12)[~normal].all()


def test_a_zero_token_stays_zero():
    x = torch.zeros(3, 32)
    x[1] = torch.randn(32)
    w = torch.randn(16, 32)
    q, s = quant.quantize_rows_fp8(w)
    y = quant.fp8_linear(x, q, s.view(-1), None)
    assert torch.equal(y[0], torch.zeros(16)) and torch.equal(y[2], torch.zeros(16))
    assert y[1].abs().sum() > 0


def test_the_float8_product_is_the_fp32_product_of_the_rounded_operands():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 64, generator=g)
    w, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    q, s = quant.quantize_rows_fp8(w)
    got = quant.fp8_linear(x, q, s.view(-1), bias)
    want = quant.reference_linear(x, q, s.view(-1), bias)
    assert got.shape == (2, 5, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and it stays near the unquantized product (a few float8 steps of each operand)
    exact = torch.nn.functional.linear(x, w, bias)
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


def test_a_layer_whose_shape_the_float8_gemm_cannot_take_keeps_its_weight():
    odd = Linear(40, 24, bias=False)
    assert not odd.quantize_fp8()
    assert odd.weight.dtype == torch.float32 and odd.weight_scale is None
    ok = Linear(64, 32, bias=True)
    x = torch.randn(3, 64)
    before = ok(x)
    assert ok.quantize_fp8()
    assert ok.weight.dtype == torch.float8_e4m3fn and ok.weight_scale.shape == (32,)
    assert (ok(x) - before).abs().max() < 0.1 * before.abs().max()


def test_a_float8_layer_takes_the_rows_attached_to_its_input():
    """The RMSNorm before a float8 layer attaches its output's float8 rows (quant.attach_rows);
    the layer multiplies those rows rather than quantizing its input again. Rows of the input
    itself give the same bits; other rows show that they are the ones used."""
    layer = Linear(64, 32, bias=False)
    assert not layer.takes_fp8_rows
    layer.quantize_fp8()
    assert layer.takes_fp8_rows
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    plain = layer(x)
    assert torch.equal(layer(quant.attach_rows(x.clone(), reference.quantize_rows_fp8(x))), plain)
    q, s = reference.quantize_rows_fp8(x)
    torch.testing.assert_close(layer(quant.attach_rows(x.clone(), (q, 2 * s))), 2 * plain)
    assert quant.rows_of(x) is None and quant.rows_of(x.view(3, 64)) is None  # (a view carries none)


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_norms_before_float8_layers_make_their_rows(tmp_path, model):
    """After quantization "fp8", each decoder layer's norms make the float8 rows of the layer
    after them (qkv_proj; gate_up_proj or the per-row float8 experts); unquantized, none does."""
    if model == "llama":
        path = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", None, vocab_size=512)
    else:
        path = make_tiny_model(tmp_path / "m", "Qwen3MoeForCausalLM", None, vocab_size=512, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32)
    fp8, _ = load_model(path, quantization="fp8")
    plain, _ = load_model(path)
    for layer in fp8.layers:
        assert layer.input_layernorm.fp8_rows and layer.post_attention_layernorm.fp8_rows
    assert not any(n.fp8_rows for layer in plain.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))
    if model == "qwen3_moe":
        assert fp8.layers[0].mlp.takes_fp8_rows and not plain.layers[0].mlp.takes_fp8_rows


def test_an_unknown_quantization_is_a_config_error():
    with pytest.raises(ConfigError, match="quantization must be one of fp8"):
        EngineConfig(quantization="int3")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_fp8_greedy_output_matches_transformers_with_the_same_roundings(tmp_path, arch):
    """Batched, with short prefill chunks (several steps per prompt) and a shared prefix,
    so that prefill, decode and mixed steps all go through the float8 layers. Qwen2 adds
    the qkv bias after the float8 product."""
    path = make_tiny_model(tmp_path / "m", arch, None, vocab_size=512, initializer_range=0.05)
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 512, (40,), generator=g).tolist()
    batch = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 33, 90)]
    batch += [shared + [5, 6], shared + [9]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    with LLM(str(path), dtype="float32", device="cpu", quantization="fp8", max_num_batched_tokens=32) as llm:
        layer = llm.engine.runner.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        assert llm.engine.runner.model.lm_head.weight.dtype == torch.float32
        outs = llm.generate(batch, params)
    cmp = Comparison()
    for p, o in zip(batch, outs):
        assert o.error is None, o.error
        compare(path, p, o.token_ids, cmp, w8a8=True)
    assert not cmp.failures, "\n".join(cmp.failures)
    assert cmp.exact >= len(batch) - 1, (cmp.exact, cmp.near_ties)
    # sharper than the tokens: the log-probabilities of our tokens, teacher-forced through
    # the emulation. Most sequences agree to float32 noise at every token; where a last-bit
    # difference (another order of float32 sums) moves a value across a float8 rounding
    # boundary, single tokens differ by up to ~1e-2, but the median stays ~1e-4. Without
    # the activations' rounding the medians are 3e-3 to 2e-2 on these models.
    hf = _hf_model(str(path), True)
    exact = 0
    for p, o in zip(batch, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        diff = (torch.tensor([t.logprob for t in o.logprobs]) - ref).abs()
        assert diff.median() < 1e-3, diff
        exact += bool(diff.max() < 1e-5)
    assert exact >= len(batch) // 2, exact
