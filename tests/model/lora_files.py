"""PEFT LoRA adapter folders for tests, written by hand (no peft package), and the oracle's
model: the base folder with each adapted weight merged, W + scale * B @ A."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

LAYERS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_adapter(folder: Path, base: Path, targets: list[str], rank: int, alpha: float, seed: int,
                 rslora: bool = False, std: float = 0.3, extra: dict | None = None) -> Path:
    """An adapter of every layer's `targets` (q_proj, ...), random A and B (B is zeros in a
    fresh PEFT adapter; trained ones are not), in PEFT's file layout."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(base))
    shapes = {name: tuple(w.shape) for name, w in
              AutoModelForCausalLM.from_config(cfg).state_dict().items()}  # (shapes only: weights unused)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for t in targets:
            out, inp = shapes[f"model.layers.{i}.{LAYERS[t]}.{t}.weight"]
            key = f"base_model.model.model.layers.{i}.{LAYERS[t]}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
              "use_rslora": rslora, "base_model_name_or_path": str(base), **(extra or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def merged(folder: Path, base: Path, adapter: Path) -> Path:
    """The base model with the adapter merged into its weights, saved as a folder of its own."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    state = model.state_dict()
    with torch.no_grad():
        for key, a in weights.items():
            if ".lora_A." in key:
                layer = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = weights[key.replace("lora_A", "lora_B")]
                state[f"{layer}.weight"] += scale * (b.double() @ a.double()).float()
    model.load_state_dict(state)
    model.save_pretrained(str(folder))
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, folder / f.name)
    return folder
