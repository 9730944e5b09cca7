"""Refuse, at load, every config value that changes the math and that the model class
does not implement, naming the field: a model that loads computes what transformers'
class of the same name computes (or the load fails here, before any weight is read).

Fields transformers' class ignores are refused too when a value says the author expected
them to matter (attention_bias on Mistral, layer_types on Mistral / Phi-3, a Llama
sliding_window): silently computing something else than the config says is the one
outcome not allowed.
"""

from __future__ import annotations

from typing import Any

from streamer.errors import ModelLoadError
from streamer.model.cohere import Cohere2ForCausalLM
from streamer.model.deepseek import DeepseekV2ForCausalLM, check_deepseek
from streamer.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from streamer.model.glm4_moe import Glm4MoeForCausalLM
from streamer.model.gpt_oss import GptOssForCausalLM
from streamer.model.granite import GraniteForCausalLM
from streamer.model.layers import GATED_ACTIVATIONS
from streamer.model.llama import LlamaForCausalLM, MistralForCausalLM
from streamer.model.moe import FUSED_ACTIVATION, MixtralForCausalLM, MoEForCausalLM, Qwen3MoeForCausalLM
from streamer.model.olmo import Olmo3ForCausalLM
from streamer.model.phi3 import Phi3ForCausalLM
from streamer.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from streamer.model.rope import rope_params, rope_type, rotary_dim
from streamer.model.smollm3 import SmolLM3ForCausalLM
from streamer.model.windows import UNIFORM_WINDOW, architecture

# rope types whose rotation is a fixed function of the position (rope.py); "dynamic" is
# one only up to max_position_embeddings (transformers recomputes it past that)
ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope", "dynamic"}
WINDOWED = (MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM,
            MixtralForCausalLM, Qwen3MoeForCausalLM, SmolLM3ForCausalLM, Olmo3ForCausalLM, Cohere2ForCausalLM,
            GptOssForCausalLM)
"""The classes with sliding-window layers (windows.py says which layers)."""


def check_config(cfg: Any, cls: type[LlamaForCausalLM], max_positions: int, source: str) -> None:
    def refuse(field: str, why: str) -> None:
        raise ModelLoadError(f"{source}: {field} = {getattr(cfg, field, None)!r} is not supported: {why}")

    name = cls.__name__
    if getattr(cfg, "vision_config", None) is not None or getattr(cfg, "text_config", None) is not None:
        refuse("vision_config", "multimodal configs are not supported; use a text-only config "
                                "(for Gemma 3: model_type gemma3_text, Gemma3ForCausalLM)")
    # (quantization_config: model/fp8_checkpoint.py loads float8 checkpoints, int4 ones through
    # model/int4_checkpoint.py, and refuses the rest)
    act = getattr(cfg, cls.act_field, None) or "silu"
    if act not in GATED_ACTIVATIONS:
        refuse(cls.act_field, f"supported activations: {', '.join(sorted(GATED_ACTIVATIONS))}")
    biased = cls is LlamaForCausalLM or issubclass(cls, (SmolLM3ForCausalLM, GraniteForCausalLM))
    if getattr(cfg, "mlp_bias", False) and (not biased or issubclass(cls, MoEForCausalLM)):
        # (transformers' Mistral, Qwen, Phi-3, Gemma, OLMo, Cohere and MoE MLPs have no bias whatever
        # the config says; DeepSeek's dense layers would take one: not implemented)
        refuse("mlp_bias", f"{name}'s MLP has no biases here (biases: Llama, SmolLM3 and Granite)")
    if getattr(cfg, "use_bidirectional_attention", False):
        refuse("use_bidirectional_attention", "only causal attention is implemented")
    if getattr(cfg, "attention_bias", False) and issubclass(
            cls, (MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM)):
        refuse("attention_bias", f"{name} has fixed biases (transformers' {name} ignores this field)")
    _check_windows(cfg, cls, refuse)
    if issubclass(cls, MoEForCausalLM):
        _check_moe(cfg, cls, refuse)
    if issubclass(cls, DeepseekV2ForCausalLM):
        check_deepseek(cfg, cls, refuse)
    if issubclass(cls, SmolLM3ForCausalLM):
        flags = getattr(cfg, "no_rope_layers", None)
        if not isinstance(flags, list) or len(flags) != cfg.num_hidden_layers or any(f not in (0, 1) for f in flags):
            refuse("no_rope_layers", f"must list 0 (NoPE) or 1 (rope) for each of the {cfg.num_hidden_layers} layers")
    _check_rope(cfg, cls, max_positions, refuse)
    if issubclass(cls, Gemma3ForCausalLM) and getattr(cfg, "attn_logit_softcapping", None):
        refuse("attn_logit_softcapping", "transformers' Gemma3 does not cap attention scores")


def _check_windows(cfg: Any, cls: type[LlamaForCausalLM], refuse: Any) -> None:
    window = getattr(cfg, "sliding_window", None)
    if window and not issubclass(cls, WINDOWED):
        refuse("sliding_window", f"{cls.__name__} has no sliding-window attention")
    types = getattr(cfg, "layer_types", None)
    if types is not None and architecture(cfg) in UNIFORM_WINDOW:
        expected = "sliding_attention" if window else "full_attention"
        if any(t != expected for t in types):
            refuse("layer_types", f"{cls.__name__} applies sliding_window to every layer "
                                  "(transformers' class ignores layer_types)")


def _check_moe(cfg: Any, cls: type[MoEForCausalLM], refuse: Any) -> None:
    """(router_jitter_noise and output_router_logits act only in training: moe.py.)"""
    experts = int(getattr(cfg, cls.experts_field, 0) or 0)
    if experts <= 0 and not issubclass(cls, Qwen3MoeForCausalLM):
        refuse(cls.experts_field, "a mixture of experts needs at least one expert")
    k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    if experts > 0 and not 0 < k <= experts:
        refuse("num_experts_per_tok", f"must be between 1 and {cls.experts_field} ({experts})")
    act = getattr(cfg, cls.act_field, None) or "silu"
    if act not in FUSED_ACTIVATION:
        refuse(cls.act_field, f"the experts implement {', '.join(sorted(FUSED_ACTIVATION))}")
    shared = [f for f in vars(cfg) if f.startswith("shared_expert") and getattr(cfg, f)]
    if shared and not cls.shared_expert:
        refuse(shared[0], f"{cls.__name__} has no shared experts")
    if issubclass(cls, Glm4MoeForCausalLM):
        groups, best = getattr(cfg, "n_group", 1), getattr(cfg, "topk_group", 1)
        if not isinstance(groups, int) or groups < 1 or experts % groups or experts // groups < 2 and groups > 1:
            refuse("n_group", f"must divide the {experts} routed experts into groups of at least 2")
        if not isinstance(best, int) or not 1 <= best <= groups or best * (experts // groups) < k:
            refuse("topk_group", f"must be between 1 and n_group ({groups}), its groups holding num_experts_per_tok")
        if int(getattr(cfg, "n_shared_experts", 0) or 0) < 1:
            refuse("n_shared_experts", "Glm4MoeForCausalLM has at least one shared expert")
        first = getattr(cfg, "first_k_dense_replace", 0)
        if not isinstance(first, int) or first < 0:
            refuse("first_k_dense_replace", "must be a non-negative integer")
    if cls.shared_expert:
        size = getattr(cfg, "shared_expert_intermediate_size", None)
        if not isinstance(size, int) or size <= 0:
            refuse("shared_expert_intermediate_size", "a shared expert needs a positive size")
    if issubclass(cls, Qwen3MoeForCausalLM):
        step = getattr(cfg, "decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            refuse("decoder_sparse_step", "must be a positive integer")


def _check_rope(cfg: Any, cls: type[LlamaForCausalLM], max_positions: int, refuse: Any) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = getattr(cfg, "rope_parameters", None) or {}
    layer_types = sorted(set(getattr(cfg, "layer_types", None) or []))
    per_type = [t for t in layer_types if isinstance(params.get(t), dict)]
    for layer_type in per_type or [None]:
        p = rope_params(cfg, layer_type)
        kind = rope_type(p)
        if kind not in ROPE_TYPES:
            refuse("rope_parameters", f"rope_type {kind!r} (supported: {', '.join(sorted(ROPE_TYPES))})")
        if kind == "dynamic" and max_positions > int(cfg.max_position_embeddings):
            refuse("rope_parameters", f"dynamic rope past max_position_embeddings ({cfg.max_position_embeddings}) "
                                      f"rescales with the sequence length; max_model_len {max_positions} needs it")
        rot = rotary_dim(cfg, head_dim, p)
        if rot != head_dim and (not cls.partial_rotary or rot % 2 or rot > head_dim or rot <= 0):
            refuse("partial_rotary_factor", f"gives {rot} rotary dims of {head_dim} (partial rotary is "
                                            "implemented for Phi3ForCausalLM and Glm4MoeForCausalLM, an even count)")
