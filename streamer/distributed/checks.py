"""What tensor parallelism refuses, before any rank starts: each message names
tensor_parallel_size and the architecture, feature or count at fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from streamer.config import EngineConfig
from streamer.errors import ConfigError

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
             "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "SmolLM3ForCausalLM",
             "Glm4MoeForCausalLM", "GraniteForCausalLM",
             "GraniteMoeForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
             "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
"""The decoders built of model/layers.py's Attention and MLP, which model/tp_layers.py shards
(Gemma's extra norms act on the whole hidden state, its scaled embedding and capped logits
on the all-reduced and gathered ones; Phi-3's fused checkpoint tensors are read in parts;
a mixture of experts splits every expert's intermediate size), and DeepSeek's latent
attention (model/deepseek.py: its heads split, the latent whole on every rank)."""


def check_model(config: EngineConfig, hf_config: Any, source: Path) -> None:
    n = config.tensor_parallel_size
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not any(a in SUPPORTED for a in archs):
        raise ConfigError(f"tensor_parallel_size={n} is not implemented for {', '.join(archs) or 'this model'} "
                          f"({source}); supported: {', '.join(SUPPORTED)}")
    # (float8 and int4 checkpoints: each rank reads its part of their scales, packed words and
    # groups, model/tp_layers.py; a part that would start inside one is refused as the model loads)
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % n:
        raise ConfigError(f"tensor_parallel_size={n} must divide the number of attention heads ({heads})")
    if (kv >= n and kv % n) or (kv < n and n % kv):
        raise ConfigError(f"tensor_parallel_size={n} and the {kv} key/value heads: one must divide the other")
    for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        inter = getattr(hf_config, field, None)
        if isinstance(inter, int) and inter % n:
            raise ConfigError(f"tensor_parallel_size={n} must divide the MLP's {field} ({inter})")


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device of this node's local_rank: cuda:(base + local_rank) from the configured
    CUDA device (so engines side by side can take different GPUs), else the CPU."""
    from streamer.model.runner import pick_device

    base = pick_device(config.device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + local_rank)


def check_devices(config: EngineConfig) -> None:
    per_node = config.tensor_parallel_size // config.nnodes
    last = rank_device(config, per_node - 1)
    if last.type == "cuda" and (last.index or 0) >= torch.cuda.device_count():
        first = rank_device(config, 0)
        raise ConfigError(f"tensor_parallel_size={config.tensor_parallel_size} needs {per_node} GPUs on this node "
                          f"from {first} on; it has {torch.cuda.device_count()}")
