"""The model's one-token GEMV decode path gives the tokens of the unfused path.

At batch 1 on CUDA every linear layer runs `kernels.gemv`, each RMSNorm runs in the
prologue of the GEMV that reads it and each residual add in the epilogue of the GEMV
that produces it (streamer/model/llama.py, DecoderLayer). Here that path runs on CPU
through the Triton interpreter: the GEMV switch is opened to CPU tensors, and greedy
tokens and logprobs are compared in float32 with the engine's usual CPU path.
"""

from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.model import layers
from tests.conftest import make_tiny_model
from tests.kernels.device import CUDA


@pytest.mark.skipif(CUDA, reason="the CPU run of the GEMV path (on a GPU, tests/gpu covers it)")
def test_one_token_gemv_path_matches_unfused(tmp_path, monkeypatch):
    # Qwen2: the Llama decoder plus the qkv bias, which the normed GEMV adds after its epilogue
    path = make_tiny_model(tmp_path / "m", "Qwen2ForCausalLM", None, vocab_size=512)
    prompt = torch.randint(3, 512, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)

    def run():
        with LLM(str(path), dtype="float32", device="cpu", cuda_graphs=False) as llm:
            return llm.generate([prompt], params)[0]

    ref = run()
    calls = {"norm": 0, "residual": 0}
    gemv = layers.gemv

    def counting_gemv(x, w, config=None, **kw):
        calls["norm"] += kw.get("norm_weight") is not None
        calls["residual"] += kw.get("residual") is not None
        return gemv(x, w, config, **kw)

    monkeypatch.setattr(layers, "gemv", counting_gemv)
    monkeypatch.setattr(layers, "use_gemv", lambda x, w: x.numel() == x.shape[-1])
    monkeypatch.setattr(layers.Linear, "decode_gemv", True)
    out = run()
    # 5 decode steps of one token, 2 layers: a normed qkv and two residual epilogues per layer
    assert calls == {"norm": 5 * 2, "residual": 5 * 2 * 2}
    assert out.token_ids == ref.token_ids
    for a, b in zip(out.logprobs, ref.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
