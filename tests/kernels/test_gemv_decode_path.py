"""The model's one-token GEMV decode path gives the tokens of the unfused path.

At batch 1 on CUDA every linear layer runs `kernels.gemv`, and the MLP's gate_up
projection `gemv_glu` with the activation in its epilogue (streamer/model/layers.py).
Here that path runs on CPU through the Triton interpreter: the GEMV switch is opened
to CPU tensors, and greedy tokens and logprobs are compared in float32 with the
engine's usual CPU path (F.linear and the torch references).
"""

from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.model import layers
from tests.conftest import make_tiny_model
from tests.kernels.device import CUDA

# tokens generated: the prefill's and DECODE_STEPS one-token steps (each a GEMV per linear
# layer through the interpreter, ~0.25 s apiece on CPU: two steps show the path as five did)
DECODE_STEPS = 2


def count_calls(monkeypatch, module, *names: str) -> dict[str, int]:
    """Wrap module.<name> for each name so that calls are counted in the returned dict."""
    calls = dict.fromkeys(names, 0)

    def counting(name):
        fn = getattr(module, name)

        def call(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return call

    for name in names:
        monkeypatch.setattr(module, name, counting(name))
    return calls


@pytest.mark.skipif(CUDA, reason="the CPU run of the GEMV path (on a GPU, tests/gpu covers it)")
def test_one_token_gemv_path_matches_unfused(tmp_path, monkeypatch):
    # Qwen2: the Llama decoder plus the qkv bias, added after the GEMV
    path = make_tiny_model(tmp_path / "m", "Qwen2ForCausalLM", None, vocab_size=512)
    prompt = torch.randint(3, 512, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=1 + DECODE_STEPS, temperature=0, ignore_eos=True, logprobs=1)

    def run():
        with LLM(str(path), dtype="float32", device="cpu", cuda_graphs=False) as llm:
            return llm.generate([prompt], params)[0]

    ref = run()
    calls = count_calls(monkeypatch, layers, "gemv", "gemv_glu")
    monkeypatch.setattr(layers, "use_gemv", lambda x, w, per_row=False: x.numel() == x.shape[-1])
    monkeypatch.setattr(layers.Linear, "decode_gemv", True)
    out = run()
    # the decode steps of one token, 2 layers: qkv, o and down per layer and the LM head, gate_up
    # and its activation in gemv_glu; and the prefill's LM head (one row: the last position)
    assert calls == {"gemv": DECODE_STEPS * (3 * 2 + 1) + 1, "gemv_glu": DECODE_STEPS * 2}
    assert out.token_ids == ref.token_ids
    for a, b in zip(out.logprobs, ref.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.skipif(CUDA, reason="the CPU run of the GEMV path (on a GPU, tests/gpu covers it)")
def test_one_token_float8_gemv_path_matches_the_scaled_mm_path(tmp_path, monkeypatch):
    """quantization "fp8" at batch 1: the float8 layers stream their weights through the GEMV
    (the same float8 operands and scales as torch._scaled_mm, another order of fp32 sums)."""
    from streamer.model import quant

    path = make_tiny_model(tmp_path / "m", "Qwen2ForCausalLM", None, vocab_size=512, initializer_range=0.05)
    prompt = torch.randint(3, 512, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=1 + DECODE_STEPS, temperature=0, ignore_eos=True, logprobs=1)

    def run():
        with LLM(str(path), dtype="float32", device="cpu", cuda_graphs=False, quantization="fp8") as llm:
            return llm.generate([prompt], params)[0]

    ref = run()
    calls = count_calls(monkeypatch, quant, "fp8_gemv", "fp8_gemv_glu")
    one_row = lambda x, w, per_row=False: x.numel() == x.shape[-1] and w.dtype == torch.float8_e4m3fn  # noqa: E731
    monkeypatch.setattr(layers, "use_gemv", one_row)
    monkeypatch.setattr(layers.Linear, "decode_gemv", True)
    out = run()
    # the one-token steps, 2 layers: qkv, o and down in the GEMV, gate_up with its activation
    # in gemv_glu; the LM head stays in float32 (not quantized)
    assert calls == {"fp8_gemv": DECODE_STEPS * 3 * 2, "fp8_gemv_glu": DECODE_STEPS * 2}
    assert out.token_ids == ref.token_ids
    for a, b in zip(out.logprobs, ref.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
