"""Which layers attend through a sliding window, and how wide, read from a transformers config.

One answer for the model (each Attention layer's `window`) and for the scheduler (pages
wholly outside every layer's window can be released): 0 is full attention, w > 0 the
last w tokens (kernels.reference.paged_attention). What the config means depends on the
architecture, as transformers' modeling code reads it:

- Mistral, Phi-3, Mixtral, Qwen3-MoE: `sliding_window` (null: none; Qwen3-MoE's config
  nulls it without use_sliding_window) on every layer; these classes ignore
  `layer_types` (config_check refuses one that says otherwise).
- Gemma 2/3, Qwen2/3: `layer_types`, whose "sliding_attention" layers use
  `sliding_window` (Qwen's config builds layer_types from use_sliding_window and
  max_window_layers, and nulls sliding_window without use_sliding_window).
- Llama: no window at all (config_check refuses a sliding_window).
"""

from __future__ import annotations

from typing import Any

from streamer.errors import ModelLoadError

KNOWN_LAYER_TYPES = {"full_attention", "sliding_attention"}
UNIFORM_WINDOW = {"MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"}
"""Architectures whose sliding_window applies to every layer."""


def architecture(cfg: Any) -> str | None:
    archs = getattr(cfg, "architectures", None) or []
    return archs[0] if archs else None


def layer_windows(cfg: Any) -> list[int]:
    """Per layer: 0 (full attention) or the sliding window in tokens."""
    n = int(cfg.num_hidden_layers)
    window = int(getattr(cfg, "sliding_window", None) or 0)
    types = getattr(cfg, "layer_types", None)
    if types is None or architecture(cfg) in UNIFORM_WINDOW:
        return [window] * n
    types = list(types)
    if len(types) != n:
        raise ModelLoadError(f"config: layer_types has {len(types)} entries for {n} layers")
    unknown = sorted(set(types) - KNOWN_LAYER_TYPES)
    if unknown:
        raise ModelLoadError(f"config: layer_types {unknown} are not supported (only {sorted(KNOWN_LAYER_TYPES)})")
    if "sliding_attention" in types and window <= 0:
        raise ModelLoadError("config: layer_types has sliding_attention layers but sliding_window is not set")
    return [window if t == "sliding_attention" else 0 for t in types]


def kv_window(cfg: Any) -> int:
    """The window of the whole KV cache: > 0 when every layer slides (the tokens more than
    this far behind a sequence's newest one are read by no layer), else 0."""
    windows = layer_windows(cfg)
    return max(windows) if windows and all(w > 0 for w in windows) else 0
