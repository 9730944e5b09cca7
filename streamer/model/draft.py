"""DraftModel: speculative decoding's draft_model method, on the runner's side.

A smaller model with the target's vocabulary proposes k tokens per speculating request;
the target verifies them in one forward (the verify chunk of engine/spec/rollback.py) and
sampling/rejection.py keeps each with probability min(1, p/q).

Its KV lives in its own pool tensors indexed by the target's page ids: a page id holds
the target's K/V of some tokens and the draft's of the same tokens, so the scheduler's
one page accounting (allocation, the radix tree, preemption, rollback) covers both, and
the pool is sized for both (model/kv_budget.py make_pool). To keep the draft's KV wherever the
target's is, every forward of the target is mirrored: the draft runs over the same packed
tokens (prefill chunks and decodes: eagerly, or its decode graphs) into its pages. The
proposals themselves are k + 1 single-token draft steps over the speculating requests (in
its decode graphs on CUDA), which write the draft's KV of every token of the verify chunk.

The scheduler sends a verify chunk's proposals as PLACEHOLDERs (it cannot know them);
`propose` draws them and returns the batch with the real tokens, plus what the
acceptance needs (the draft's distributions of sampled rows).

Invariants:
  - the draft's KV of every computed token of every page equals a fresh draft prefill's
    (mirror runs after each target forward, over the same slots);
  - the draft draws unconstrained, also for a grammar request: the target's rows are masked
    (the scheduler fills their masks from the draws: Batch.masks_await_drafts), so a
    proposal the grammar refuses is never kept and the output follows the masked target;
  - a host KV tier moves the draft's KV of a page with the target's (`page_parts`: the target
    pool's companions, kv/host.py), so a prefix that comes back from the host proposes as well
    as before it left;
  - under tensor parallelism the draft is whole and on rank 0 alone (ModelRunner builds it
    unsharded there; distributed/runner.py sends the other ranks the step with its proposals in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from streamer.errors import ConfigError
from streamer.kv.pages import PagePool
from streamer.messages import Batch, SampledToken, SamplingParams, SeqChunk
from streamer.model.context import run_eager
from streamer.model.graphs import DecodeGraphs
from streamer.model.loader import load_model
from streamer.model.packing import prepare
from streamer.model.windows import kv_window, layer_windows
from streamer.sampling.draw import package
from streamer.sampling.processing import BiasCache, edits_logits
from streamer.sampling.rejection import (
    ACCEPT_STREAM,
    DRAFT_STREAM,
    accept_or_redraw,
    draw,
    probs_of,
    processed_logits,
    processed_probs,
    uniforms,
)
from streamer.staging import PinnedRing


@dataclass
class Proposed:
    """What one step's draft proposed, for the acceptance (resolve)."""

    drafts: dict[str, list[int]]
    """Per speculating request, its proposals in order."""
    rows: list[tuple[int, int]] = field(default_factory=list)
    """(first sampling row, k) of each verify chunk with non-greedy rows."""
    q: list[torch.Tensor] = field(default_factory=list)
    """For those chunks, the draft's distributions [k, V] at their proposals."""
    tokens: list[list[int]] = field(default_factory=list)
    logits: torch.Tensor | None = None
    """A step whose sampling waits for its masks: the target's logits as the forward left them
    (the plan's are processed in place)."""


class DraftModel:
    def __init__(self, model_path: str, *, target_cfg: Any, config: Any, device: torch.device,
                 max_model_len: int, kv_dtype: torch.dtype) -> None:
        self.model, self.cfg = self.load(model_path, config, device, max_model_len)
        if getattr(self.model, "latent_cache", None) is not None:
            raise ConfigError(f"speculative_config model {model_path}: a draft with multi-head latent attention "
                              "(DeepSeek) is not supported")
        if int(self.cfg.vocab_size) != int(target_cfg.vocab_size):
            raise ConfigError(f"speculative_config model {model_path}: its vocabulary has {self.cfg.vocab_size} "
                              f"tokens, the target's {target_cfg.vocab_size}: a draft needs the target's tokenizer")
        window = kv_window(target_cfg)
        mine = layer_windows(self.cfg)
        if window and not all(0 < w <= window for w in mine):
            raise ConfigError(f"speculative_config model {model_path}: the target keeps only the last {window} "
                              f"tokens' KV (a sliding window); the draft's layers need windows within it, not {mine}")
        self.device = device
        self.kv_dtype = kv_dtype
        self.pool: PagePool | None = None
        self.staging = PinnedRing()
        self.biases: BiasCache = BiasCache()
        self.graphs: DecodeGraphs | None = None
        """The draft's decode steps (its proposals, the mirror of plain decodes), on CUDA."""

    steps_after = 1
    """Draft steps of a chunk of k proposals beyond k: the (k + 1)-th writes the draft's KV of
    the k-th proposal (mirror skips verify chunks)."""
    shift = 0
    """The position of propose's first step relative to the verify chunk's start."""

    def load(self, model_path: str, config: Any, device: torch.device, max_model_len: int) -> tuple[Any, Any]:
        return load_model(model_path, dtype=config.dtype, device=device, load_format=config.load_format,
                          max_positions=max_model_len, seed=config.seed + 1)

    def bytes_per_page(self, page_size: int) -> int:
        c = self.cfg
        return PagePool.bytes_per_page(c.num_hidden_layers, page_size, c.num_key_value_heads, self.model.head_dim,
                                       self.kv_dtype)

    def make_pool(self, num_pages: int, page_size: int, graphs_bs: int = 0, max_pages: int = 0) -> None:
        """The draft's KV tensors under the target's num_pages page ids; with graphs_bs, its
        decode steps captured up to that batch size."""
        c = self.cfg
        self.pool = PagePool(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads, self.model.head_dim,
                             self.kv_dtype, self.device)
        if graphs_bs and getattr(self.model, "cuda_graphs_ok", True):
            self.graphs = DecodeGraphs(self.model, self.pool.k, self.pool.v, graphs_bs, max_pages)
            with torch.inference_mode():
                self.graphs.capture()

    def page_parts(self) -> list[torch.Tensor]:
        """Byte views [layers, pages, bytes] of what the draft keeps under each page id: its KV."""
        from streamer.kv.host import pool_parts

        assert self.pool is not None
        return pool_parts(self.pool)

    def release(self) -> None:
        """Drop the model, its graphs and its pool (ModelRunner.release)."""
        self.graphs = self.pool = None
        self.model = None  # type: ignore[assignment]

    def _run(self, x: dict[str, Any]) -> torch.Tensor:
        assert self.pool is not None
        return run_eager(self.model, x, self.pool.k, self.pool.v)

    @torch.inference_mode()
    def mirror(self, batch: Batch, x: dict[str, Any]) -> None:
        """Write the draft's KV of the tokens a target forward just wrote (same slots). A step
        of verify chunks only needs none: propose wrote their KV already."""
        if all(s.num_draft for s in batch.seqs):
            return
        if self.graphs is not None and x["graph"] is not None and x["max_q_len"] == 1 \
                and self.graphs.fits(x["input_ids"].shape[0], x["page_table"].shape[1]):
            self.graphs.replay(x)  # (a decode step: its LM head is in the graph, unused here)
            return
        self._run(x)

    @torch.inference_mode()
    def propose(self, batch: Batch) -> tuple[Batch, Proposed]:
        """Draw the proposals of batch's verify chunks (their PLACEHOLDERs) with the draft:
        single-token steps, each request's row processed as the target's row at the same
        position will be (its parameters, history with the proposals so far, bans). A chunk
        of k proposals takes k + 1 steps: the last writes the draft's KV of its k-th proposal,
        so that with the earlier steps' the draft holds the KV of every token the verify
        chunk computes (mirror skips verify chunks)."""
        assert self.pool is not None
        ps = self.pool.page_size
        # each verify chunk: (seq index, first sampling row)
        spec: list[tuple[int, int]] = []
        row = 0
        for i, s in enumerate(batch.seqs):
            if not s.sample:
                continue
            if s.num_draft:
                spec.append((i, row))
            row += 1 + s.num_draft
        ks = [batch.seqs[i].num_draft for i, _ in spec]
        drawn: list[tuple[list[int], torch.Tensor]] = []  # per step: (its chunks, their draws on the device)
        qs: list[list[torch.Tensor]] = [[] for _ in spec]
        prev = torch.zeros(0, dtype=torch.long, device=self.device)
        prev_rows: dict[str, int] = {}
        prev_live: list[int] = []
        for j in range(max(ks) + self.steps_after):
            live = [n for n, k in enumerate(ks) if k + self.steps_after > j]
            chunks, params, hist, banned = [], [], [], []
            for n in live:
                i, r = spec[n]
                s = batch.seqs[i]
                tok = s.token_ids[0] if j == 0 else -1  # (a PLACEHOLDER: the last step's draw, on the device)
                chunks.append(SeqChunk(s.request_id, [tok], s.start + self.shift + j, s.page_table, True))
                jj = min(j, ks[n])
                params.append(batch.params[r + jj])
                so_far = self._so_far(drawn, n) if j and batch.params[r].reads_history else []
                hist.append(self._history(batch, r, so_far, j))
                banned.append(batch.banned[r + jj] if r + jj < len(batch.banned) else [])
            x = prepare(Batch(batch.step, chunks, [], [], []), page_size=ps, device=self.device,
                        staging=self.staging, graphs=self.graphs, extend_graphs=None, split_decode_tokens=1 << 62,
                        last_tokens=prev, last_rows=prev_rows)
            logits = self._step_logits(x, j, [prev_live.index(n) for n in live] if j else [])
            if all(p.greedy and not edits_logits(p) for p in params) and not any(banned):
                toks = logits.argmax(-1)
            else:
                q = processed_probs(logits, params, hist, banned, self.biases)
                pos = [len(h) if h else 0 for h in hist]
                toks = draw(q, uniforms(params, pos, DRAFT_STREAM))
                for m, n in enumerate(live):
                    if j < ks[n] and not params[m].greedy:
                        qs[n].append(q[m])
            drawn.append((live, toks))
            prev, prev_rows, prev_live = toks, {c.request_id: m for m, c in enumerate(chunks)}, live
        # one copy to the host for all the draws (step j's draw is proposal j + 1)
        host = torch.cat([t for _, t in drawn]).tolist()
        drafts: list[list[int]] = [[] for _ in spec]
        at = 0
        for j, (live, _) in enumerate(drawn):
            for m, n in enumerate(live):
                if j < ks[n]:
                    drafts[n].append(host[at + m])
            at += len(live)
        proposed = Proposed({batch.seqs[i].request_id: d for (i, _), d in zip(spec, drafts)})
        seqs = list(batch.seqs)
        histories = list(batch.histories)
        for n, (i, r) in enumerate(spec):
            s = seqs[i]
            seqs[i] = msgspec.structs.replace(s, token_ids=[s.token_ids[0], *drafts[n]])
            if qs[n]:
                proposed.rows.append((r, s.num_draft))
                proposed.q.append(torch.stack(qs[n]))
                proposed.tokens.append(drafts[n])
            for j in range(s.num_draft + 1):
                if r + j < len(histories) and batch.params[r + j].reads_history:
                    histories[r + j] = self._history(batch, r, drafts[n], j)
        return msgspec.structs.replace(batch, seqs=seqs, histories=histories), proposed

    def _step_logits(self, x: dict[str, Any], j: int, prev_rows: list[int]) -> torch.Tensor:
        """Logits [rows, vocab] of propose's step j (one token per live chunk, prepared in x);
        prev_rows: each row's row in step j - 1 (j > 0)."""
        if x["graph"] is not None:
            return x["graph"].replay(x)
        return self.model.compute_logits(self._run(x)[x["last"]])[: x["n_sample"]]

    @staticmethod
    def _so_far(drawn: list[tuple[list[int], torch.Tensor]], n: int) -> list[int]:
        """Chunk n's draws of the steps so far, on the host (only rows whose history counts:
        penalties, seeds)."""
        return [int(t[live.index(n)]) for live, t in drawn]

    @staticmethod
    def _history(batch: Batch, row: int, drafts: list[int], j: int) -> list[int]:
        """The output a verify chunk's row j follows: the request's output, then its first j
        proposals (row 0's history is the output as the scheduler sent it)."""
        if row >= len(batch.histories) or not batch.params[row].reads_history:
            return []
        return [*batch.histories[row], *drafts[:j]]

    def resolve(self, tokens: torch.Tensor, logits: torch.Tensor, batch: Batch, proposed: Proposed
                ) -> tuple[torch.Tensor, dict[int, SampledToken]]:
        """The sampled rows of a verify step with the draft's non-greedy proposals decided by
        rejection: row j of a chunk is its proposal where kept, else the redraw. (Greedy rows,
        and the last row of each chunk, are the plain sampler's draws already.) Also, per row
        decided here whose request asks for logprobs, its token with them."""
        if not proposed.rows:
            return tokens, {}
        idx: list[int] = []
        params: list[SamplingParams] = []
        hist: list[list[int]] = []
        banned: list[list[int]] = []
        for r, k in proposed.rows:
            for j in range(k):
                idx.append(r + j)
                params.append(batch.params[r + j])
                hist.append(batch.histories[r + j] if r + j < len(batch.histories) else [])
                banned.append(batch.banned[r + j] if r + j < len(batch.banned) else [])
        rows = torch.tensor(idx, device=logits.device)
        masks = None if batch.masks is None else batch.masks[idx]
        lp = processed_logits(logits[rows], params, hist, banned, self.biases, masks)
        q = torch.cat(proposed.q)
        d = torch.tensor([t for ts in proposed.tokens for t in ts], device=logits.device)
        pos = [len(h) for h in hist]
        picked = accept_or_redraw(probs_of(lp, params), q, d, uniforms(params, pos, ACCEPT_STREAM),
                                  uniforms(params, pos, 0))
        tokens = tokens.clone()
        tokens[rows] = picked
        with_logprobs: dict[int, SampledToken] = {}
        if any(p.logprobs is not None for p in params):
            for row, t in zip(idx, package(lp, picked, params)):
                if t.logprob is not None:
                    with_logprobs[row] = t
        return tokens, with_logprobs
