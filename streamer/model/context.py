"""Per-forward metadata, set by the runner around one model call.

Layers read it instead of threading page tables and slot mappings through
every forward signature.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class ForwardContext:
    slot_mapping: torch.Tensor
    """[T] int64: where each new token's K/V is written (page * page_size + offset)."""
    page_table: torch.Tensor
    """[B, max_pages] int32: page ids of each sequence."""
    seq_lens: torch.Tensor
    """[B] int32: context length of each sequence including its new tokens."""
    cu_q_lens: torch.Tensor
    """[B+1] int32: offsets of each sequence's new tokens in the packed batch."""
    max_q_len: int
    k_cache: torch.Tensor
    """[layers, pages, page_size, kv_heads, head_dim]."""
    v_cache: torch.Tensor
    tiles: torch.Tensor | None = None
    """Extend attention's tile list (kernels.attention.extend_tiles), set by CUDA-graph
    steps: the launch grid then depends on the padded size only."""
    block_m: int = 0
    """The query block the tile list was built for."""
    num_decodes: int = 0
    """Eager mixed steps: the first num_decodes sequences have one query token each, and
    attention runs them through the decode kernel (kernels.ops.paged_attention)."""
    max_seq_len: int | None = None
    """The context decode attention chooses its split count for (kernels.attention.paged_decode's
    max_seq_len); None: the page table's width. Eager steps give the decode graphs' width, so that
    a sequence's keys are split as a graph replay splits them: the same bits either way."""
    lora_ids: torch.Tensor | None = None
    """[T] int64: each token's LoRA adapter (1..n, 0: the base model), or None when no token of
    the step has one (model/lora.py)."""
    lora_masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    """The step's LoRA masks by column layout (model/lora.py: computed once a forward, and gone with it)."""


_current: ForwardContext | None = None
_rows_as_decode = False


def rows_as_decode() -> bool:
    """Whether the layers now compute each row as decode computes its one row (the GEMV with
    M = 1's config, row by row; attention split as at batch 1). Set around the model and its LM head by DecodeGraphs built
    with rows_as_decode: the rows of a speculative verify step at batch 1, whose logits must
    equal plain decoding's bit for bit, so that greedy output is the same with speculation."""
    return _rows_as_decode


@contextmanager
def computing_rows_as_decode(on: bool = True) -> Iterator[None]:
    global _rows_as_decode
    before, _rows_as_decode = _rows_as_decode, on
    try:
        yield
    finally:
        _rows_as_decode = before


def set_context(ctx: ForwardContext | None) -> None:
    global _current
    _current = ctx


def lora_ids() -> torch.Tensor | None:
    """The step's ForwardContext.lora_ids (None also outside a model call: an LM head's)."""
    return None if _current is None else _current.lora_ids


def lora_masks() -> dict[tuple[int, torch.dtype], torch.Tensor]:
    """The step's ForwardContext.lora_masks (outside a model call: a dict of its own, kept by no one)."""
    return {} if _current is None else _current.lora_masks


def get_context() -> ForwardContext:
    assert _current is not None, "model called outside ModelRunner.forward"
    return _current


def run_eager(model: Any, x: dict[str, Any], k_cache: torch.Tensor, v_cache: torch.Tensor, num_decodes: int = 0,
              max_seq_len: int | None = None) -> torch.Tensor:
    """Hidden states of model over a step prepared by packing.prepare, run eagerly into the
    given KV tensors. The index arrays go in as int32, as in the graphs' buffers: the attention
    kernels of eager steps are then the variants built at capture (the decode kernel of a mixed
    step's split, int64, was first built mid-run on a fresh machine: a 1.4 s stall in W3).
    max_seq_len: ForwardContext.max_seq_len."""
    ctx = ForwardContext(
        slot_mapping=x["slot_mapping"],
        page_table=x["page_table"].to(torch.int32),
        seq_lens=x["seq_lens"].to(torch.int32),
        cu_q_lens=x["cu_q_lens"].to(torch.int32),
        max_q_len=x["max_q_len"],
        k_cache=k_cache,
        v_cache=v_cache,
        num_decodes=num_decodes,
        max_seq_len=max_seq_len,
        lora_ids=x.get("lora_ids"),
    )
    set_context(ctx)
    try:
        return model(x["input_ids"], x["positions"])
    finally:
        set_context(None)
