"""A config value that changes the math and that the model class does not implement is
refused at load with a ModelLoadError naming the field (no config is accepted and then
ignored)."""

from __future__ import annotations

import pytest

from streamer.errors import ModelLoadError
from streamer.model.config_check import check_config
from streamer.model.registry import model_class

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def config(model_type: str, arch: str, **kw):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **{**SMALL, **kw})
    cfg.architectures = [arch]
    return cfg


def check(cfg, max_positions: int = 256) -> None:
    check_config(cfg, model_class(cfg.architectures, "config.json"), max_positions, "config.json")


@pytest.mark.parametrize(
    "model_type,arch,kw,field",
    [
        ("gemma2", "Gemma2ForCausalLM", dict(hidden_activation="gelu"), "hidden_activation"),
        ("mistral", "MistralForCausalLM", dict(mlp_bias=True), "mlp_bias"),  # (transformers' has no MLP bias)
        ("llama", "LlamaForCausalLM", dict(sliding_window=64), "sliding_window"),
        ("mistral", "MistralForCausalLM", dict(attention_bias=True), "attention_bias"),
        ("mistral", "MistralForCausalLM", dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
        ("gemma3_text", "Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma3_text", "Gemma3ForCausalLM", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        ("llama", "LlamaForCausalLM", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        ("smollm3", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0, 1]), "no_rope_layers"),
        ("qwen3_moe", "Qwen3MoeForCausalLM", dict(mlp_bias=True), "mlp_bias"),
        # 5 rotary dims of 16: an odd count (0.3 gives 4, which is implemented)
        ("phi3", "Phi3ForCausalLM", dict(partial_rotary_factor=0.3125), "partial_rotary_factor"),
    ],
)
def test_unimplemented_values_are_refused_by_name(model_type, arch, kw, field):
    with pytest.raises(ModelLoadError, match=field):
        check(config(model_type, arch, **kw))


def test_rope_that_rescales_with_the_sequence_is_refused_past_its_range():
    cfg = config("llama", "LlamaForCausalLM", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    check(cfg, max_positions=256)  # within max_position_embeddings: the plain table, as transformers
    with pytest.raises(ModelLoadError, match="rope_parameters"):
        check(cfg, max_positions=1024)


def test_multimodal_gemma3_config_is_refused():
    from transformers import Gemma3Config

    cfg = Gemma3Config(text_config=SMALL)
    cfg.architectures = ["Gemma3ForCausalLM"]
    with pytest.raises(ModelLoadError, match="vision_config"):
        check(cfg)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        model_class(cfg.architectures, "config.json")


@pytest.mark.parametrize(
    "model_type,arch,kw",
    [
        ("mistral", "MistralForCausalLM", dict(sliding_window=32)),
        ("qwen2", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)),
        ("gemma2", "Gemma2ForCausalLM", dict(sliding_window=32)),
        ("phi3", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, sliding_window=32)),
    ],
)
def test_implemented_configs_pass(model_type, arch, kw):
    check(config(model_type, arch, **kw))
