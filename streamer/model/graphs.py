"""CUDA graphs for decode steps and for short prefill / mixed steps.

A decode step of batch size B replays the graph captured for the smallest
ladder size >= B. Inputs are copied into static buffers; rows past B are
padding: they write their K/V to slot -1 (skipped) and read page 0 (scratch).
Each captured graph runs the whole model up to the final norm; the LM head runs
eagerly on the B real rows only. That is one more launch per step, and it saves
the LM head's padded rows (at batch 488 in the 512 graph: 0.87 against 0.79 ms of
a 128k vocabulary) and a [size, vocab] logits buffer kept alive per graph (3.7 GB
for the 52 graphs up to 512 at such a vocabulary; the hidden states are 0.1 GB).

A step with multi-token chunks (a prefill, or decodes mixed with one) of T
tokens replays the ExtendGraphs graph of the smallest token count >= T. Eagerly,
such a step costs about 15 ms of kernel launches on the host for a 32-layer
model, more than the GPU needs for a few hundred tokens: that was most of a
lone request's time to first token. Its attention launches over a tile list
(kernels.attention.extend_tiles) padded to a bound that depends on T only;
padding tokens write no K/V, and only the hidden states of the real tokens are
used (the LM head runs eagerly on the rows that sample).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from streamer.model.context import ForwardContext, computing_rows_as_decode, set_context

log = logging.getLogger(__name__)


def token_ladder(max_tokens: int) -> list[int]:
    """Token counts of the ExtendGraphs, multiples of 16 about 1/12 apart, ending at
    max_tokens: a step is padded by less than 16 tokens or 1/12 of itself. (At 1/6 apart,
    a 512-token prompt with a few decodes beside it was padded to 592: 15% more work.)"""
    sizes = [16]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] + max(16, sizes[-1] // 12 // 16 * 16))
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def capture_ladder(
    sizes: list[int], run: Callable[[int], torch.Tensor], pool: Any, serving: bool = False
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor], Any]:
    """A graph of run(size) for each size, and its output tensor. Largest first: the
    smaller graphs reuse its memory pool (and `pool`, if given, is shared with others).
    serving: captured while the engine serves (DecodeGraphs' lazy sizes), so a CUDA call another
    thread makes meanwhile (the host tier's copies) is not an error of this capture."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    for n in reversed(sizes):
        run(n)  # warm up (Triton compiles, the allocator settles)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local" if serving else "global"):
            outputs[n] = run(n)
        if pool is None:
            pool = g.pool()
        graphs[n] = g
    torch.cuda.synchronize()
    return graphs, outputs, pool


class CaptureFailed(RuntimeError):
    """A capture while serving failed: the step runs eagerly instead (ModelRunner), and LoraGraphs
    turns itself off."""


def keep_outputs(model: Any, outputs: dict[int, dict[str, torch.Tensor]], size: int) -> None:
    """Keep the attributes a run of model just set besides its result (model.graph_outputs:
    an EAGLE-3 target's features, a head's outputs before its norm) as size's: inside a
    capture they are the graph's static outputs, which each replay rewrites."""
    names = getattr(model, "graph_outputs", ())
    if names:
        outputs[size] = {name: getattr(model, name) for name in names}


def set_outputs(model: Any, outputs: dict[int, dict[str, torch.Tensor]], size: int, rows: int) -> None:
    """After a replay of size's graph: the model's graph_outputs are its static ones (the first rows)."""
    for name, t in outputs.get(size, {}).items():
        setattr(model, name, t[:rows])


def ladder(max_bs: int) -> list[int]:
    """Batch sizes of the decode graphs, ending at max_bs (so that the largest batches
    allowed replay a graph too). 16 apart up to 256 rows, where the weights' bytes dominate
    and padding is nearly free; above, the linear layers are compute-bound and a padded row
    costs a real one's work: 1/32 apart (8 rows at 256, 16 at 512), at most ~3% padding."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    while sizes[-1] < max_bs:
        sizes.append(sizes[-1] + sizes[-1] // 32 // 8 * 8)
    return [s for s in sizes if s < max_bs] + [max(max_bs, 1)]


class _LazySizes:
    """What DecodeGraphs and ExtendGraphs share for LoRA graphs (loras): each size captured when a
    replay first needs it, and the static lora_ids (empty without loras)."""

    lora_ids: torch.Tensor
    graphs: dict[int, torch.cuda.CUDAGraph]
    hidden: dict[int, torch.Tensor]
    pool: Any

    def reset_inputs(self) -> None:
        raise NotImplementedError

    def _run(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    @property
    def loras(self) -> bool:
        return self.lora_ids.numel() > 0

    def lora_view(self, size: int) -> torch.Tensor | None:
        """The step context's lora_ids for a run of `size` (None without loras)."""
        return self.lora_ids[:size] if self.loras else None

    def capture_when_needed(self, size: int) -> None:
        """Capture size while serving (LoRA graphs: the first time a step needs it). The static
        inputs are reset first, as the warm-up run writes K/V at their slots (rows of an earlier
        step's, whose pages may be another's now)."""
        self.reset_inputs()
        try:
            with torch.inference_mode():
                captured, hidden, self.pool = capture_ladder([size], self._run, self.pool, serving=True)
        except Exception as e:  # noqa: BLE001 - the caller runs the step eagerly
            raise CaptureFailed(f"a CUDA graph of size {size} could not be captured while serving: {e!r}") from e
        self.graphs.update(captured)
        self.hidden.update(hidden)

    def before_replay(self, x: dict[str, Any], n: int, size: int) -> None:
        """Before size's replay of a step of n rows or tokens: its capture if there is none yet, then
        the step's adapter ids (the padding's: 0)."""
        if size not in self.graphs:
            self.capture_when_needed(size)
        if self.loras:
            self.lora_ids[:n].copy_(x["lora_ids"], non_blocking=True)
            self.lora_ids[n:size].fill_(0)


class DecodeGraphs(_LazySizes):
    """rows_as_decode: graphs whose every row computes as a lone decode row does (the GEMVs with
    M = 1's config, row by row; attention split as at batch 1), for the rows of a speculative
    verify step at batch 1 (exact_verify.verify_rows), from 2 rows up to max_bs: the verified tokens'
    logits are then plain decoding's bit for bit, and so is greedy output.

    loras: graphs of decode steps with LoRA adapters' tokens (model/lora.py: each row's adapter in a
    static lora_ids buffer, 0 for the base model's rows and the padding). They hold the adapters'
    tensors as they were at capture, so LoraGraphs drops them when an adapter comes or goes; and
    each size is captured the first time a step needs it (`replay`), not all at start: a server
    may never see an adapter's batch of most sizes, and a reload would otherwise recapture them all."""

    def __init__(self, model: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, max_bs: int, max_pages: int,
                 rows_as_decode: bool = False, loras: bool = False, pool: Any = None) -> None:
        dev = k_cache.device
        self.model = model
        self.k_cache, self.v_cache = k_cache, v_cache
        self.rows_as_decode = rows_as_decode
        self.lora_ids = torch.zeros(max_bs if loras else 0, dtype=torch.long, device=dev)
        self.sizes = [s for s in (2, 4, 8) if s < max_bs] + [max_bs] if rows_as_decode else ladder(max_bs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.page_table = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_q_lens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        """Each graph's static model.graph_outputs (keep_outputs)."""
        self.pool = pool
        """Shared with the base model's graphs for LoRA graphs: a lazy capture then takes its
        intermediates from memory the pool already holds, not from what the KV budget left."""

    def capture(self) -> None:
        self.graphs, self.hidden, self.pool = capture_ladder(self.sizes, self._run, self.pool)

    def reset_inputs(self) -> None:
        """The static inputs as at the start: padding rows throughout."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.page_table.zero_()
        self.lora_ids.zero_()

    def _run(self, bs: int) -> torch.Tensor:
        ctx = ForwardContext(
            slot_mapping=self.slot_mapping[:bs],
            page_table=self.page_table[:bs],
            seq_lens=self.seq_lens[:bs],
            cu_q_lens=self.cu_q_lens[: bs + 1],
            max_q_len=1,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            lora_ids=self.lora_view(bs),
        )
        set_context(ctx)
        try:
            with computing_rows_as_decode(self.rows_as_decode):
                out = self.model(self.input_ids[:bs], self.positions[:bs])
            keep_outputs(self.model, self.outputs, bs)
            return out
        finally:
            set_context(None)

    def fits(self, batch_size: int, width: int) -> bool:
        return batch_size <= self.max_bs and width <= self.page_table.shape[1]

    def replay(self, x: dict[str, Any]) -> torch.Tensor:
        """Logits [B, vocab] of a decode batch prepared by ModelRunner.prepare."""
        b = x["input_ids"].shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.before_replay(x, b, bs)
        self.input_ids[:b].copy_(x["input_ids"], non_blocking=True)
        self.positions[:b].copy_(x["positions"], non_blocking=True)
        self.slot_mapping[:b].copy_(x["slot_mapping"], non_blocking=True)
        self.slot_mapping[b:bs].fill_(-1)
        width = x["page_table"].shape[1]
        self.page_table[:b, :width].copy_(x["page_table"], non_blocking=True)
        self.seq_lens[:b].copy_(x["seq_lens"], non_blocking=True)
        self.seq_lens[b:bs].fill_(1)
        self.graphs[bs].replay()
        set_outputs(self.model, self.outputs, bs, b)
        with computing_rows_as_decode(self.rows_as_decode):
            return self.model.compute_logits(self.hidden[bs][:b])


class ExtendGraphs(_LazySizes):
    """Graphs of the whole model (no LM head) for steps of up to `max_tokens` tokens from
    up to `max_seqs` sequences, by padded token count. loras: as DecodeGraphs' (each token's
    adapter in a static lora_ids; each size captured when first needed)."""

    def __init__(
        self, model: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, max_tokens: int, max_seqs: int,
        max_pages: int, block_m: int, pool: Any = None, loras: bool = False,
    ) -> None:
        dev = k_cache.device
        self.model = model
        self.k_cache, self.v_cache = k_cache, v_cache
        self.sizes = token_ladder(max_tokens)
        self.max_seqs, self.block_m = max_seqs, block_m
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.page_table = torch.zeros(max_seqs, max_pages, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.cu_q_lens = torch.zeros(max_seqs + 1, dtype=torch.int32, device=dev)
        self.tiles = torch.full((self.num_tiles(n),), -1, dtype=torch.int32, device=dev)
        self.lora_ids = torch.zeros(n if loras else 0, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        self.pool = pool
        self.replays = 0

    def num_tiles(self, tokens: int) -> int:
        """Bound on the tile list of any batch of <= tokens tokens (one partial block per sequence)."""
        return -(-tokens // self.block_m) + min(self.max_seqs, tokens)

    def padded(self, tokens: int) -> int:
        return next(s for s in self.sizes if s >= tokens)

    def fits(self, tokens: int, seqs: int, width: int) -> bool:
        return tokens <= self.sizes[-1] and seqs <= self.max_seqs and width <= self.page_table.shape[1]

    def capture(self) -> None:
        self.graphs, self.hidden, self.pool = capture_ladder(self.sizes, self._run, self.pool)

    def reset_inputs(self) -> None:
        """The static inputs as at the start: no sequence, no tile, padding tokens."""
        self.slot_mapping.fill_(-1)
        self.page_table.zero_()
        self.seq_lens.zero_()
        self.cu_q_lens.zero_()
        self.tiles.fill_(-1)
        self.lora_ids.zero_()

    def _run(self, t: int) -> torch.Tensor:
        ctx = ForwardContext(
            slot_mapping=self.slot_mapping[:t],
            page_table=self.page_table,
            seq_lens=self.seq_lens,
            cu_q_lens=self.cu_q_lens,
            max_q_len=t,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            tiles=self.tiles[: self.num_tiles(t)],
            block_m=self.block_m,
            lora_ids=self.lora_view(t),
        )
        set_context(ctx)
        try:
            out = self.model(self.input_ids[:t], self.positions[:t])
            keep_outputs(self.model, self.outputs, t)
            return out
        finally:
            set_context(None)

    def replay(self, x: dict[str, Any]) -> torch.Tensor:
        """Hidden states [T, hidden] of a step prepared by ModelRunner.prepare with its tile
        list (x["tiles"], padded to num_tiles(padded(T)))."""
        n = x["input_ids"].shape[0]
        t = self.padded(n)
        self.before_replay(x, n, t)
        b, width = x["page_table"].shape
        self.input_ids[:n].copy_(x["input_ids"], non_blocking=True)
        self.positions[:n].copy_(x["positions"], non_blocking=True)
        self.slot_mapping[:n].copy_(x["slot_mapping"], non_blocking=True)
        self.slot_mapping[n:t].fill_(-1)
        self.page_table[:b, :width].copy_(x["page_table"], non_blocking=True)
        self.seq_lens[:b].copy_(x["seq_lens"], non_blocking=True)
        self.cu_q_lens[: b + 1].copy_(x["cu_q_lens"], non_blocking=True)
        self.tiles[: self.num_tiles(t)].copy_(x["tiles"], non_blocking=True)
        self.graphs[t].replay()
        self.replays += 1
        set_outputs(self.model, self.outputs, t, n)
        return self.hidden[t][:n]


class LoraGraphs:
    """The decode and extend graphs of steps with LoRA adapters' tokens (loras), with the base
    graphs' limits and memory pool. They hold the adapters' tensors as they were at capture: made
    anew, empty (each size is captured when first replayed), after any change to the adapters."""

    def __init__(self, base: DecodeGraphs, extend: ExtendGraphs | None) -> None:
        self.base, self.base_extend = base, extend
        self.version = -1
        """The adapters' version (model/lora.py Adapters.version) the graphs below were made for."""
        self.decode: DecodeGraphs | None = None
        self.extend: ExtendGraphs | None = None
        self.off: str | None = None
        """Why these graphs are off (a capture failed): adapters' steps then run eagerly."""

    def turn_off(self, why: str) -> None:
        log.warning("LoRA steps run eagerly from now on: %s", why)
        self.off, self.decode, self.extend = why, None, None

    def current(self, adapters: Any) -> tuple[DecodeGraphs | None, ExtendGraphs | None]:
        """The graphs for `adapters` as they are; (None, None) while there is none, or when off."""
        if self.off is not None:
            return None, None
        if adapters.version != self.version:
            if self.decode is not None:  # (a replay queued before the change ends before they go)
                torch.cuda.synchronize(self.base.k_cache.device)
            self.decode = self.extend = None
            self.version = adapters.version
        if self.decode is None and adapters.index:
            g, eg = self.base, self.base_extend
            self.decode = DecodeGraphs(g.model, g.k_cache, g.v_cache, g.max_bs, g.page_table.shape[1], loras=True,
                                       pool=g.pool)
            self.extend = None if eg is None else ExtendGraphs(
                eg.model, eg.k_cache, eg.v_cache, eg.sizes[-1], eg.max_seqs, eg.page_table.shape[1], eg.block_m,
                pool=g.pool, loras=True)
        return self.decode, self.extend
