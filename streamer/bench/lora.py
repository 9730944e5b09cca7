"""A random LoRA adapter for a model folder (`streamer bench offline --lora-rank`): what serving
every request through an adapter costs, on the dummy weights of a benchmark shape."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def layer_shapes(cfg: dict) -> dict[str, tuple[str, int, int]]:
    """Each adaptable layer of one decoder layer: (its module, in features, out features). A
    mixture of experts' MLP is not adaptable (model/lora.py TARGETS): attention only there."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim
    shapes = {"q_proj": ("self_attn", hidden, q), "k_proj": ("self_attn", hidden, kv),
              "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", q, hidden)}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if not experts:
        inter = cfg["intermediate_size"]
        shapes.update({"gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter),
                       "down_proj": ("mlp", inter, hidden)})
    return shapes


def random_adapter(model_dir: Path, rank: int, folder: Path, seed: int = 0) -> Path:
    """A PEFT folder (adapter_config.json, adapter_model.safetensors) of rank `rank` on every
    layer's adaptable projections of the config in model_dir; small random A and B (bf16), so
    that the adapted model's activations stay as tame as the dummy base model's."""
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"--lora-rank: {rank} is not a rank (1 or more)")
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = layer_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, (module, n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{module}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in ** 0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(shapes), "bias": "none"}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
