"""SmolLM3: the Llama decoder (biases on q/k/v/o from attention_bias) with NoPE layers:
layer i rotates q and k only where no_rope_layers[i] is 1 (transformers' SmolLM3Attention
`use_rope`; the config makes every no_rope_layer_interval-th layer NoPE by default).
Sliding layers come from layer_types (the config slides only NoPE layers, and only with
use_sliding_window).

A NoPE layer takes a rotary table of cos 1 and sin 0: the rotation kernels then give back
q and k unchanged (x * 1 + rotate_half(x) * 0 is x exactly), so every layer keeps one path."""

from __future__ import annotations

import torch

from streamer.model.llama import LlamaForCausalLM


def unrotated_table(table: torch.Tensor) -> torch.Tensor:
    """A rotary table of a table's shape whose rotation is none: cos 1, sin 0 (a NoPE layer's)."""
    half = table.shape[1] // 2
    return torch.cat([torch.ones_like(table[:, :half]), torch.zeros_like(table[:, half:])], dim=1)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def rope_tables(self, max_positions: int) -> tuple[dict[str, torch.Tensor], list[str]]:
        tables, _ = super().rope_tables(max_positions)
        table = tables["cos_sin"]
        names = ["cos_sin" if use_rope else "cos_sin_none" for use_rope in self.config.no_rope_layers]
        return {"cos_sin": table, "cos_sin_none": unrotated_table(table)}, names
