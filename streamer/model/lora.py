"""LoRA adapters (EngineConfig.lora_modules), served beside the base model and batched with it.

An adapter is a PEFT folder: adapter_config.json (r, lora_alpha, target_modules, use_rslora) and
adapter_model.safetensors (an adapter_model.bin alone is refused) with, for each adapted layer L, L.lora_A.weight
[r, in] and L.lora_B.weight [out, r]. Adapter k changes L's output by
scale_k * (x A_k^T) B_k^T, scale_k = lora_alpha / r (/ sqrt(r) with use_rslora).

Every adapter is loaded at start into the layers it targets (`attach`): a Linear whose adapters
are A = [A_1; ...; A_n] ([n R, in]; R: the most rows an adapter has in that layer, the others
padded with zeros) and B = [s_1 B_1, ..., s_n B_n] ([out, n R], each scale folded in). A fused layer (qkv_proj,
gate_up_proj) takes its parts' adapters side by side: q's B rows at q's rows, k's at k's, with
their own A rows, as the checkpoint's q/k/v load (model/llama.py STACKED). Then each token t of a
step, with adapter a_t (0: the base model), adds ((x A^T) * M) B^T, M[t, j] = 1 where column j is
adapter a_t's: one pair of small GEMMs for every adapter at once, the same shapes whatever the
batch's mix (LoraWeights.add_delta). A step with an adapter's token replays graphs of their own
(model/graphs.py, loras), captured for the adapters as they are, where the base model's step would
replay graphs (model/packing.py).

Refused by name (ModelLoadError): DoRA, biases, modules_to_save, fan_in_fan_out, a rank or alpha
pattern per layer, targets that are not this model's linear layers (embeddings, the LM head,
experts, quantized int4 layers, MLA's latent projections: what is not in TARGETS). A float8 base
layer is fine: the delta is added to its output. Under tensor parallelism each rank holds its part
of every adapter (`_rank_part`), as the layer's weight is split.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from streamer.errors import ModelLoadError
from streamer.model.context import lora_masks
from streamer.model.tp_group import current as tensor_parallel

PREFIX = "base_model.model."
"""PEFT's prefix of the base model's names."""

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
"""The layers an adapter may change: attention's and the dense MLP's projections (Phi-3's come fused)."""


def lora_key(name: str, n: int) -> str:
    """The key of the n-th adapter an engine loads (engine/adapters.py says why keys)."""
    return f"{name}@{n}"


def lora_name(key: str) -> str:
    return key.rpartition("@")[0]


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Checkpoint layer name (model.layers.0.self_attn.q_proj) -> (A [r, in], B [out, r])."""


@dataclass(slots=True)
class LoraWeights:
    """A Linear's adapters (the module's docstring says how they are laid out)."""

    a: torch.Tensor
    """[n R, in]"""
    b: torch.Tensor
    """[out, n R]"""
    owner: torch.Tensor
    """[n R] int: the adapter (1..n) of each column."""

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """y (the layer's output for rows x) plus what the adapters add: each row x[t] through
        adapter ids[t]'s (0: nothing). Three kernels a layer (x A^T, the mask, then B's product
        added into y in place by the GEMM itself) where a step replays each of them for every
        adapted layer: at batch 1 their count, not their FLOPs, is the cost."""
        h = x.to(self.a.dtype) @ self.a.t()
        h *= _mask(ids, self.owner, h.dtype)
        if y.dim() == 2 and y.is_contiguous() and y.dtype == h.dtype:
            return y.addmm_(h, self.b.t())
        return y + (h @ self.b.t()).to(y.dtype)


def _mask(ids: torch.Tensor, owner: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, n R] in dtype: 1 where column j is row t's adapter's (owner[j] == ids[t]). Every layer holds each
    adapter's columns, so a column count is a layout, and the layers of one share the mask: computed once a
    forward, kept in its context (gone with it: a mask made in a CUDA graph's capture lives in its pool)."""
    masks = lora_masks()
    key = (owner.numel(), dtype)
    mask = masks.get(key)
    if mask is None:
        mask = masks[key] = (ids[:, None] == owner[None, :]).to(dtype)
    return mask


REFUSED_CONFIG = {"use_dora": "DoRA adapters", "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) weights",
                  "modules_to_save": "modules_to_save (fully trained layers)", "rank_pattern": "a rank per layer",
                  "alpha_pattern": "an alpha per layer", "layers_to_transform": "layers_to_transform",
                  "lora_bias": "biases on lora_B (lora_bias)", "layer_replication": "layer_replication (copied layers)",
                  "trainable_token_indices": "trainable_token_indices (trained embedding rows)"}


def read_adapter(name: str, path: str) -> Adapter:
    """One PEFT adapter folder, checked (ModelLoadError naming what it cannot take)."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ModelLoadError(f"LoRA adapter {name!r}: {folder} needs adapter_config.json and "
                             "adapter_model.safetensors (a PEFT adapter folder)")
    cfg: dict[str, Any] = json.loads(config_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, what in REFUSED_CONFIG.items():
        if cfg.get(key):
            raise ModelLoadError(f"LoRA adapter {name!r}: {what} ({key}) are not supported")
    if cfg.get("bias", "none") != "none":
        raise ModelLoadError(f"LoRA adapter {name!r}: bias {cfg['bias']!r} is not supported (only none)")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    from safetensors.torch import load_file

    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ModelLoadError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A or lora_B weight")
        pairs.setdefault(layer, {})[kind[0]] = tensor
    weights = {}
    for layer, ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != rank or ab["B"].shape[1] != rank:
            raise ModelLoadError(f"LoRA adapter {name!r}: layer {layer!r} needs lora_A [{rank}, in] and "
                                 f"lora_B [out, {rank}]")
        weights[layer] = (ab["A"], ab["B"])
    return Adapter(name, rank, scale, weights)


class Adapters:
    """The adapters a model serves, each under its key (`lora_key`: what a step's sequences name,
    SamplingParams.lora as the engine's tokenizer rewrote it; engine/adapters.py): those of
    EngineConfig.lora_modules loaded at start, the others while serving (`update`)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, modules: list[tuple[str, str]]) -> None:
        self.model, self.dtype = model, dtype
        self.group = tensor_parallel()
        """The tensor-parallel group the model was built in (None: one rank), for adapters loaded later."""
        self.loaded: dict[str, Adapter] = {lora_key(name, k): read_adapter(name, path)
                                           for k, (name, path) in enumerate(modules)}
        self.index: dict[str, int] = {}
        """key -> the adapter's index in the layers (1..n; 0: the base model)."""
        self.version = 0
        """Counts the changes to the layers' adapters (what captured them, CUDA graphs, goes stale)."""
        if self.loaded:
            self._attach(self.loaded)

    def update(self, key: str, adapter: Adapter | None) -> None:
        """Load `adapter` under key, or unload key's (None); ModelLoadError leaves everything as it was."""
        loaded = dict(self.loaded)
        if adapter is None:
            loaded.pop(key, None)
        else:
            loaded[key] = adapter
        self._attach(loaded)

    def _attach(self, loaded: dict[str, Adapter]) -> None:
        attach(self.model, list(loaded.values()), self.dtype, self.group)
        self.loaded = loaded
        self.index = {key: k + 1 for k, key in enumerate(loaded)}
        self.version += 1


def attach(model: nn.Module, adapters: list[Adapter], dtype: torch.dtype, group: Any = None) -> None:
    """Give each Linear the adapters that target it (LoraWeights, in dtype: the activations'), and
    every other Linear none; ModelLoadError for a target that is not one of the model's linear
    layers, with no layer changed. group: the model's tensor-parallel group (each rank its part)."""
    targets: dict[str, list[tuple[int, str, torch.Tensor, torch.Tensor]]] = {}
    for k, adapter in enumerate(adapters):
        for layer, (a, b) in adapter.weights.items():
            name = layer.removeprefix("model.")
            if group is not None:
                a, b = _rank_part(group, model, adapter.name, name, a, b)
            fused = model.fused_module(name) if hasattr(model, "fused_module") else name
            targets.setdefault(fused, []).append((k, name, a, b.float() * adapter.scale))
    built = {fused: _stacked(model, fused, parts, adapters, dtype) for fused, parts in targets.items()}
    # (model/layers.py's Linear holds `lora` and adds the delta; this module imports no model code)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and hasattr(module, "lora"):
            module.lora = built.get(name)


def _stacked(model: nn.Module, fused: str, parts: list[tuple[int, str, torch.Tensor, torch.Tensor]],
             adapters: list[Adapter], dtype: torch.dtype) -> LoraWeights:
    """The LoraWeights of one layer: `parts` are (adapter index, checkpoint layer, A, scaled B)."""
    module = model.get_submodule(fused) if _has(model, fused) else None
    adaptable = isinstance(module, nn.Linear) and hasattr(module, "lora")
    if not adaptable or parts[0][1].rsplit(".", 1)[-1] not in TARGETS:
        raise ModelLoadError(f"LoRA adapter {adapters[parts[0][0]].name!r}: {parts[0][1]!r} is not a linear "
                             f"layer this model can adapt ({type(module).__name__ if module else 'none'})")
    assert isinstance(module, nn.Linear)
    # each adapter's columns: its parts' ranks side by side (q, k, v of a fused qkv_proj)
    width = max(sum(a.shape[0] for j, _, a, _ in parts if j == k) for k in range(len(adapters)))
    a_all = torch.zeros(len(adapters) * width, module.in_features)
    b_all = torch.zeros(module.out_features, len(adapters) * width)
    used = [0] * len(adapters)
    for k, name, a, b in parts:
        rows = (0, module.out_features) if fused == name else model.part_rows(name)
        if a.shape[1] != module.in_features or b.shape[0] != rows[1]:
            raise ModelLoadError(f"LoRA adapter {adapters[k].name!r}: {name!r} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}, the layer takes [r, {module.in_features}] and [{rows[1]}, r]")
        col, r = k * width + used[k], a.shape[0]
        a_all[col:col + r] = a.float()
        b_all[rows[0]:rows[0] + rows[1], col:col + r] = b
        used[k] += r
    if fused.endswith("qkv_proj") and hasattr(model, "qkv_rows_permutation"):
        perm = model.qkv_rows_permutation(module)  # (the rotary reordering the weights' rows took)
        if perm is not None:
            b_all = b_all[perm]
    owner = torch.arange(1, len(adapters) + 1).repeat_interleave(width)
    device = module.weight.device
    return LoraWeights(a_all.to(device, dtype), b_all.to(device, dtype), owner.to(device))


def _rank_part(group: Any, model: nn.Module, adapter: str, name: str, a: torch.Tensor, b: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of an adapter of layer `name`: B's rows of its output rows
    (a column-parallel layer: q/k/v, gate/up), or A's columns of its input columns (a row-parallel
    layer: o, down; each rank's delta x_r A_r^T B^T is then part of the partial sum the layer's
    all-reduce adds up). Adapters of checkpoint-fused layers (Phi-3's qkv_proj, gate_up_proj) are
    refused: their B rows would need the q | k | v split of the weight's."""
    from streamer.model.tp_layers import linear_split

    if name.rsplit(".", 1)[-1] in ("qkv_proj", "gate_up_proj"):
        raise ModelLoadError(f"LoRA adapter {adapter!r}: {name!r} is a fused layer in the checkpoint; its "
                             "adapters are not supported with tensor_parallel_size > 1")
    split = linear_split(group, model, name)
    if split is None:  # (a layer every rank holds whole: the whole delta on each)
        return a, b
    axis, first, n = split
    return (a, b[first:first + n]) if axis == 0 else (a[:, first:first + n], b)


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
