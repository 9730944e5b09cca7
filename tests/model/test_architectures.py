"""Mistral, Qwen2 with sliding layers, Gemma 2, Gemma 3 (text), Phi-3, SmolLM3, Granite, OLMo 2,
OLMo 3, Command R and Command R7B equal transformers
(float32, CPU): greedy output token for token, prompt logprobs over prompts several times
longer than the sliding window, whatever the prefill chunk or page size, and with the
prefix from the radix cache.

The tiny models make each difference visible: windows of 16-24 tokens under prompts of up
to 100, Gemma's soft-caps small enough to bite (5 on scores, 3 on logits), a
query_pre_attn_scalar other than head_dim, non-zero Gemma norm weights (x * (1 + w)),
Gemma 3's linear-scaled global rope beside its local one, Phi-3's longrope short
factors and half-rotary heads (partial_rotary_factor 0.5), SmolLM3's NoPE layer (sliding)
beside a rotary one, with biases on q/k/v/o, Granite's four multipliers far from 1, OLMo's
whole-projection q/k norms and post-norms (OLMo 3 with a sliding layer of its own rope),
Cohere's LayerNorms, parallel layers and interleaved rotary (Command R7B's full layer NoPE).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamer import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.model.test_greedy_vs_transformers import assert_matches, prompts, run_and_compare
from tests.oracle import _hf_model

ARCHS = {
    "mistral": ("MistralForCausalLM", dict(sliding_window=16)),
    # layer 0 full, layer 1 sliding (Qwen's config: layers >= max_window_layers slide)
    "qwen2": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=3.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        sliding_window=16, query_pre_attn_scalar=32, final_logit_softcapping=3.0, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
    # every sequence here stays within original_max_position_embeddings, where transformers'
    # longrope is the short factors (rope.py; test_longrope_table_is_transformers_rotation
    # checks the long ones)
    "phi3": ("Phi3ForCausalLM", dict(
        sliding_window=24, max_position_embeddings=512, original_max_position_embeddings=128,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.1, 2.0, 4.0, 7.5]})),
    # layer 0 rotates, layer 1 is NoPE and slides (SmolLM3's config slides NoPE layers only)
    # each of Granite's four scalars far from 1 (so that each is tested)
    "granite": ("GraniteForCausalLM", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                           attention_multiplier=0.015625, logits_scaling=8.0, attention_bias=True)),
    "olmo2": ("Olmo2ForCausalLM", dict(attention_bias=True, pad_token_id=None)),
    # layer 0 slides, layer 1 attends to all (with its own rope base)
    "olmo3": ("Olmo3ForCausalLM", dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                        "full_attention": {"rope_type": "default",
                                                                           "rope_theta": 500000.0}},
                                       pad_token_id=None)),
    "cohere": ("CohereForCausalLM", dict(logit_scale=0.25, attention_bias=True, pad_token_id=None)),
    # Llama's mlp_bias (the biases, zero as initialised, perturbed: perturb_norms)
    "llama_mlp_bias": ("LlamaForCausalLM", dict(mlp_bias=True)),
    # Command R+'s per-head q/k LayerNorms (their weights perturbed: perturb_norms)
    "cohere_qk": ("CohereForCausalLM", dict(logit_scale=0.25, use_qk_norm=True, pad_token_id=None)),
    # layers 0 slides and rotates, layer 1 attends to all without rotary
    "cohere2": ("Cohere2ForCausalLM", dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                           logit_scale=0.25, pad_token_id=None)),
    "smollm3": ("SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=16,
                                           attention_bias=True, pad_token_id=None)),
}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def perturb_norms(folder: Path, match: str = "norm") -> None:
    """Gemma initialises its norm weights to 0 (x * (1 + 0)), Command R+ its per-head q/k norms'
    to 1; give them values, so that the offset and the per-head weights are tested."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if match in name:
            tensors[name] = t + 0.3 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory, default_model) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    out = {}
    for name, (arch, kw) in ARCHS.items():
        out[name] = make_tiny_model(root / name, arch, default_model, **kw)
        if name.startswith("gemma") or name == "cohere_qk":
            perturb_norms(out[name])
        if name == "llama_mlp_bias":
            perturb_norms(out[name], "mlp")
    return out


@pytest.fixture(scope="module")
def engines(arch_models):
    """One engine of default settings per architecture, shared by the tests below."""
    started: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in started:
            started[name] = LLM(str(arch_models[name]))
        return started[name]

    yield get
    for llm in started.values():
        llm.close()


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_matches_transformers(arch_models, engines, name):
    llm = engines(name)
    batch = prompts(llm.tokenizer, 3, 20, 90, seed=1)
    assert_matches(run_and_compare(llm, arch_models[name], batch, GREEDY), 3)


@pytest.mark.parametrize("name", list(ARCHS))
def test_prompt_logprobs_past_the_window_match_transformers(arch_models, engines, name):
    """100 prompt tokens, 4-6 windows: every position's logprob within 1e-4 of
    transformers'. The same weights without the window give other logprobs (so the
    window is what is tested)."""
    from transformers import AutoModelForCausalLM

    path = arch_models[name]
    llm = engines(name)
    (ids,) = prompts(llm.tokenizer, 1, 100, 100, seed=4)
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1))
    assert out.error is None, out.error

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]

    want = logprobs(_hf_model(str(path)))
    ours = torch.tensor(out.prompt_logprobs)
    assert ours.shape == want.shape
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    # (without a window: Granite's residual multiplier, OLMo 2's norms are what is flipped)
    flip = {"granite": {"residual_multiplier": 1.0}, "olmo2": {"rms_norm_eps": 0.5},
            "cohere": {"layer_norm_eps": 0.5}, "cohere_qk": {"layer_norm_eps": 0.5},
            "llama_mlp_bias": {"mlp_bias": False}}.get(name, {"sliding_window": 4096})
    unwindowed = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **flip).eval()
    assert (logprobs(unwindowed) - want).abs().max() > 1e-2


@pytest.mark.parametrize(
    "name,chunk,page_size",
    # every architecture at page sizes 1 and 16, with two of the chunk sizes 1, 7 and 64
    [("mistral", 1, 16), ("mistral", 7, 1), ("gemma2", 7, 1), ("gemma2", 64, 16), ("phi3", 7, 16),
     ("phi3", 1, 1), ("gemma3", 64, 1), ("gemma3", 1, 16), ("qwen2", 7, 16), ("qwen2", 64, 1), ("smollm3", 7, 1)],
)
def test_chunk_and_page_size_do_not_change_output(arch_models, name, chunk, page_size):
    path = arch_models[name]
    lo, hi = (20, 40) if chunk == 1 else (20, 90)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(path), max_num_batched_tokens=chunk, page_size=page_size) as llm:
        batch = prompts(llm.tokenizer, 3, lo, hi, seed=2)
        alone = [llm.generate([p], params)[0].token_ids for p in batch]
        together = [o.token_ids for o in llm.generate(batch, params)]
        assert alone == together
        assert_matches(run_and_compare(llm, path, batch, params), 3)


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_cached_prefix_gives_the_same_output(arch_models, engines, name):
    llm = engines(name)
    (ids,) = prompts(llm.tokenizer, 1, 90, 90, seed=5)
    first, second = (llm.generate([ids], GREEDY)[0] for _ in range(2))
    assert second.cached_tokens >= 64, "the second run takes the prompt's pages from the radix cache"
    assert second.token_ids == first.token_ids
    assert_matches(run_and_compare(llm, arch_models[name], [ids], GREEDY), 1)


def test_longrope_table_is_transformers_rotation(arch_models):
    """Below original_max_position_embeddings the table is transformers' short rotation,
    from there on its long one (what transformers uses once a sequence is that long), on
    the rotated half of each head; the other half is left alone (cos 1, sin 0)."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from streamer.model.rope import rope_cos_sin

    cfg = AutoConfig.from_pretrained(str(arch_models["phi3"]))
    table = rope_cos_sin(cfg, 16, 512)
    x = torch.zeros(1, 1, 16)

    def hf_rotation(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = Phi3RotaryEmbedding(cfg)(x, torch.arange(seq_len)[None])
        return cos[0, :, :4], sin[0, :, :4]  # the 4 frequencies of 8 rotated dims

    short_cos, short_sin = hf_rotation(128)
    long_cos, long_sin = hf_rotation(512)
    assert torch.equal(table[:128, :4], short_cos) and torch.equal(table[:128, 8:12], short_sin)
    assert torch.equal(table[128:, :4], long_cos[128:]) and torch.equal(table[128:, 8:12], long_sin[128:])
    assert not torch.allclose(long_cos[:128], short_cos)
    assert (table[:, 4:8] == 1).all() and (table[:, 12:] == 0).all()
