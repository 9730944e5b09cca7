"""Rotary tables [max_positions, head_dim] float32 (cos | sin), computed as transformers does.

Scaled variants (llama3, linear, yarn, ...) come from transformers' own ROPE_INIT_FUNCTIONS
so the frequencies are identical to the reference. Three cases need more than one call:

- per-layer-type rope (Gemma 3: `rope_parameters` keyed by "sliding_attention" and
  "full_attention"): one table per layer type, `layer_type` picks it.
- longrope (Phi-3): transformers rotates a whole sequence with the short factors while it
  is at most original_max_position_embeddings long and with the long ones past that
  (Phi3ForCausalLM.prepare_inputs_for_generation drops its cache when a sequence crosses
  the limit and recomputes every key with the long factors). A paged cache rotates each
  key once (the radix tree shares it between requests of any length), so here the choice
  is per position: short factors below original_max_position_embeddings, long from there
  on. That is exactly transformers' result for every sequence (prompt and output) up to
  original_max_position_embeddings tokens; a longer one differs from it in the rotation
  of its first original_max_position_embeddings keys (`longrope_note`, logged at load;
  with max_model_len <= original_max_position_embeddings nothing differs).
- partial rotary (partial_rotary_factor < 1): only the first rot_dim dims of a head turn.
  The kernels rotate whole heads (pairs i, i + head_dim/2), so the loader permutes the
  q/k rows of each head (`partial_rotary_permutation`) so that the rotated pairs land on
  those pairs, and the table gives the other dims cos 1, sin 0 (unchanged). q.k is the
  same under a permutation applied to both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def rope_params(cfg: Any, layer_type: str | None = None) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type] or {}
    return dict(params)


def rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def rotary_dim(cfg: Any, head_dim: int, params: dict[str, Any]) -> int:
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * float(factor))


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype inside the block: the loader builds a model in its own dtype
    (a float32 build first would need twice the weights' memory), and the tables here are
    computed in float32 whatever the default."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def rope_cos_sin(cfg: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first head_dim/2 columns, sin in the
    last (times the rope attention scaling); columns past rot_dim/2 are cos 1, sin 0."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"), default_dtype(torch.float32):  # (whatever device and dtype the model is built in)
        params = rope_params(cfg, layer_type)
        kind = rope_type(params)
        rot = rotary_dim(cfg, head_dim, params)
        kw = {"layer_type": layer_type} if layer_type is not None else {}
        positions = torch.arange(max_positions, dtype=torch.float)[:, None]
        if kind == "default":
            base = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
            freqs, scaling = positions * inv_freq[None, :], 1.0
        elif kind == "longrope":
            init = ROPE_INIT_FUNCTIONS[kind]
            short, scaling = init(cfg, torch.device("cpu"), **kw)
            original = int(params["original_max_position_embeddings"])
            long, _ = init(cfg, torch.device("cpu"), seq_len=original + 1, **kw)
            use_long = positions >= original
            freqs = torch.where(use_long, positions * long[None, :].float(), positions * short[None, :].float())
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"), **kw)
            freqs = positions * inv_freq[None, :].float()
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        pad = head_dim // 2 - cos.shape[1]
        if pad:
            cos = torch.cat((cos, torch.ones(max_positions, pad)), dim=-1)
            sin = torch.cat((sin, torch.zeros(max_positions, pad)), dim=-1)
        return torch.cat((cos, sin), dim=-1)


def partial_rotary_permutation(head_dim: int, rot: int) -> torch.Tensor:
    """new dim -> old dim of one head: transformers turns pairs (i, i + rot/2), i < rot/2,
    and leaves dims rot.. alone; the kernels turn (i, i + head_dim/2). The rotated halves
    go to the front of each half of the head, the unrotated dims fill the rest."""
    half, pas = rot // 2, (head_dim - rot) // 2
    old = list(range(half)) + list(range(rot, rot + pas)) + list(range(half, rot)) + list(range(rot + pas, head_dim))
    return torch.tensor(old)


def longrope_note(cfg: Any, max_positions: int) -> str | None:
    """Why prompts past original_max_position_embeddings differ from transformers (module
    docstring), or None where the table matches it for every context this model allows."""
    params = rope_params(cfg)
    if rope_type(params) != "longrope":
        return None
    original = int(params["original_max_position_embeddings"])
    if max_positions <= original:
        return None
    return (
        f"longrope: a sequence longer than original_max_position_embeddings ({original}) keeps the short "
        f"factors on its first {original} positions (transformers re-rotates the whole sequence with the "
        "long factors; a paged cache rotates each key once). Outputs equal transformers' up to "
        f"{original} tokens; set max_model_len <= {original} to stay there"
    )
