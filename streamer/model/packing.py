"""Batch packing: a Batch's host lists -> the index tensors of one forward.

A Batch mixes prefill chunks and single-token decodes with no padding: the tokens of all
sequences are concatenated, each with its absolute position and the slot (page *
page_size + offset) where its K/V goes; each sequence's page table becomes a row of the
block table. Only the last position of a sequence that samples reaches the LM head.
Packing also decides how the step runs: replayed from the decode graphs, from the extend
graphs, or eagerly (a mixed step with long decodes splits its attention).

Everything is built with numpy on the host and reaches the device in one asynchronous
copy from pinned memory (upload).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from streamer.messages import Batch
from streamer.model.graphs import DecodeGraphs, ExtendGraphs
from streamer.staging import PinnedRing


def prepare(
    batch: Batch,
    *,
    page_size: int,
    device: torch.device,
    staging: PinnedRing,
    graphs: DecodeGraphs | None,
    extend_graphs: ExtendGraphs | None,
    split_decode_tokens: int,
    last_tokens: torch.Tensor,
    last_rows: dict[str, int],
    loras: dict[str, int] | None = None,
    lora_graphs: tuple[DecodeGraphs | None, ExtendGraphs | None] = (None, None),
) -> dict[str, Any]:
    """Host lists -> the tensors of one forward (numpy on the host, one copy each).

    last_tokens, last_rows: the tokens the previous step sampled, still on the device, and
    each sampling request's row in them (PLACEHOLDER ids are read from there). loras: each LoRA
    adapter's index by key (model/lora.py Adapters.index); a step with an adapter's token has its
    tokens' adapters in lora_ids (model/lora.py) and replays lora_graphs (the runner's decode and
    extend graphs with adapters) where the base model's step would replay graphs."""
    ps = page_size
    seqs = batch.seqs
    lens = [len(s.token_ids) for s in seqs]
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64, int(cu[-1]))
    starts = np.array([s.start for s in seqs], dtype=np.int64)
    seq_lens = (starts + lens).astype(np.int32)
    # absolute position of every token: its sequence's start + its index in the chunk
    owner = np.repeat(np.arange(len(seqs)), lens)
    positions = starts[owner] + (np.arange(int(cu[-1])) - cu[:-1][owner])
    width = max(len(s.page_table) for s in seqs)
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s.page_table)] = s.page_table
    slots = table[owner, positions // ps].astype(np.int64) * ps + positions % ps
    last = [int(cu[i + 1]) - 1 for i, s in enumerate(seqs) if s.sample]
    if batch.spec:  # a verify chunk samples at its last num_draft + 1 positions (engine/spec)
        last = [r for i, s in enumerate(seqs) if s.sample for r in range(int(cu[i + 1]) - 1 - s.num_draft, int(cu[i + 1]))]
    n_sample = len(last)
    if last:
        # the LM head of eager and extend-graph steps sees a few row counts only: at
        # saturation the step thread spent 28% of its time in LM-head GEMM calls of
        # ever-new shapes (0% after this and the eager warm-up, made together); extra
        # rows are dropped
        last += last[:1] * (padded_rows(n_sample) - n_sample)
    lp_rows: list[int] = []
    lp_targets: list[int] = []
    lp_owner: list[tuple[str, int, int]] = []  # (request, positions, top tokens wanted at each)
    for i, s in enumerate(seqs):
        if s.logprob_targets:
            first = int(cu[i]) + s.logprob_from
            lp_rows.extend(range(first, first + len(s.logprob_targets)))
            lp_targets.extend(s.logprob_targets)
            lp_owner.append((s.request_id, len(s.logprob_targets), s.logprob_top))
    # embedding requests: the hidden state of their last position (an eager step: the decode
    # graphs end in the LM head)
    embed_rows = [(s.request_id, int(cu[i + 1]) - 1) for i, s in enumerate(seqs) if s.embed]
    decode = max(lens) == 1 and all(s.sample for s in seqs) and not embed_rows
    lora_tok = None
    if any(s.lora is not None for s in seqs):
        index = loras or {}
        lora_tok = np.repeat(np.array([index[s.lora] if s.lora is not None else 0 for s in seqs], np.int64), lens)
        graphs, extend_graphs = lora_graphs  # (the others hold the base model's layers alone)
    graph: DecodeGraphs | ExtendGraphs | None = None
    if decode and graphs is not None and graphs.fits(len(seqs), width):
        graph = graphs
    # A mixed step whose leading decodes hold a long context runs eagerly, its decodes
    # through the decode kernel: in the extend kernel (CUDA graphs of mixed steps) each
    # of them would read its pages once per query head.
    num_decodes = 0
    if not decode:
        num_decodes = next((i for i, s in enumerate(seqs) if lens[i] != 1 or not s.sample), len(seqs))
        if int(seq_lens[:num_decodes].sum()) < split_decode_tokens:
            num_decodes = 0
    eg = extend_graphs
    tiles = np.zeros(0, dtype=np.int32)
    # (a decode step too large for the decode graphs runs eagerly, not in the extend graphs)
    if (graph is None and eg is not None and not decode and not num_decodes and not lp_rows and not embed_rows
            and eg.fits(int(cu[-1]), len(seqs), width)):
        from kernels.attention import extend_tiles

        graph = eg
        tiles = extend_tiles(lens, eg.block_m, pad_to=eg.num_tiles(eg.padded(int(cu[-1]))))
    pending = np.flatnonzero(ids < 0)
    # tokens sampled by the previous step, still on the device (overlap scheduling)
    pending_rows = np.array([last_rows[seqs[owner[i]].request_id] for i in pending], dtype=np.int64)
    # Every index array travels in one pinned buffer and one asynchronous copy. A blocking
    # copy (torch.tensor(..., device=)) waits for the step in flight, which undid the
    # overlap of host preparation with the device; pinned memory also spares the driver
    # staging each of nine small pageable copies.
    parts = [ids, positions, slots, seq_lens, cu, np.array(last, dtype=np.int64), pending, pending_rows,
             table.ravel(), tiles]
    if lora_tok is not None:
        parts.append(lora_tok)
    dev_buf, offsets = upload(parts, device, staging)
    views = [dev_buf[at : at + a.size] for at, a in zip(offsets, parts)]
    input_ids, pos_t, slots_t, seq_lens_t, cu_t, last_t, pend_t, rows_t, table_t, tiles_t = views[:10]
    if len(pending):
        input_ids[pend_t] = last_tokens[rows_t]
    return dict(
        input_ids=input_ids,
        positions=pos_t,
        slot_mapping=slots_t,
        page_table=table_t.view(len(seqs), width),
        seq_lens=seq_lens_t,
        cu_q_lens=cu_t,
        max_q_len=max(lens),
        last=last_t,
        n_sample=n_sample,
        graph=graph,
        tiles=tiles_t,
        num_decodes=num_decodes,
        lp_rows=lp_rows,
        lp_targets=lp_targets,
        lp_owner=lp_owner,
        embed_rows=embed_rows,
        lora_ids=views[10] if lora_tok is not None else None,
    )


def upload(parts: list[np.ndarray], device: torch.device, staging: PinnedRing) -> tuple[torch.Tensor, list[int]]:
    """Concatenate int arrays into one int64 tensor on the device; returns it and where
    each part starts. Parts start on 128-byte boundaries: Triton specializes kernels on
    16-byte pointer alignment, so unaligned views would compile new variants mid-run."""
    offsets, n = [], 0
    for a in parts:
        offsets.append(n)
        n += -(-a.size // 16) * 16
    if device.type == "cuda":
        host = staging.take(max(n, 1))
    else:
        host = torch.zeros(max(n, 1), dtype=torch.int64)
    view = host.numpy()
    for at, a in zip(offsets, parts):
        view[at : at + a.size] = a.ravel()
    if device.type == "cuda":
        dev = host.to(device, non_blocking=True)
        staging.record()
        return dev, offsets
    return host.to(device, non_blocking=True), offsets


def padded_rows(n: int) -> int:
    """1, 2, 4, 8, then multiples of 16."""
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 16) * 16
