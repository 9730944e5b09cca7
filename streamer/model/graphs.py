"""CUDA graphs for decode steps.

A decode step of batch size B replays the graph captured for the smallest
ladder size >= B. Inputs are copied into static buffers; rows past B are
padding: they write their K/V to slot -1 (skipped) and read page 0 (scratch),
and their logits are dropped. Each captured graph runs the whole model and the
LM head, so a replay is one launch from the host.
"""

from __future__ import annotations

from typing import Any

import torch

from streamer.model.context import ForwardContext, set_context


def ladder(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_bs] or [1]


class DecodeGraphs:
    def __init__(self, model: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, max_bs: int, max_pages: int) -> None:
        dev = k_cache.device
        self.model = model
        self.k_cache, self.v_cache = k_cache, v_cache
        self.sizes = ladder(max_bs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.page_table = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_q_lens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def capture(self) -> None:
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._run(bs)  # warm up (Triton compiles, allocator settles)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[bs] = self._run(bs)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def _run(self, bs: int) -> torch.Tensor:
        ctx = ForwardContext(
            slot_mapping=self.slot_mapping[:bs],
            page_table=self.page_table[:bs],
            seq_lens=self.seq_lens[:bs],
            cu_q_lens=self.cu_q_lens[: bs + 1],
            max_q_len=1,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
        )
        set_context(ctx)
        try:
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            return self.model.compute_logits(hidden)
        finally:
            set_context(None)

    def fits(self, batch_size: int, width: int) -> bool:
        return batch_size <= self.max_bs and width <= self.page_table.shape[1]

    def replay(self, x: dict[str, Any]) -> torch.Tensor:
        """Logits [B, vocab] of a decode batch prepared by ModelRunner.prepare."""
        b = x["input_ids"].shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(x["input_ids"], non_blocking=True)
        self.positions[:b].copy_(x["positions"], non_blocking=True)
        self.slot_mapping[:b].copy_(x["slot_mapping"], non_blocking=True)
        self.slot_mapping[b:bs].fill_(-1)
        width = x["page_table"].shape[1]
        self.page_table[:b, :width].copy_(x["page_table"], non_blocking=True)
        self.seq_lens[:b].copy_(x["seq_lens"], non_blocking=True)
        self.seq_lens[b:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[bs][:b]
