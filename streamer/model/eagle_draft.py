"""EagleDraft: speculative decoding's eagle3 and eagle methods, on the runner's side.

An EAGLE head (model/eagle_heads.py) proposes from the target's features: of the target's
hidden states, which its forward returns as aux_hidden (LlamaForCausalLM.aux_layers, set
here: EAGLE-3 reads residual streams at three depths, EAGLE-1/2 the output), what the head
makes of them (target_feature: EAGLE-3's fc; EAGLE-1/2's are the states). The head's input at position i is
(token i + 1, feature i): so the head lags the target by one token, and this is a
DraftModel (model/draft.py: the proposals, their acceptance and rejection, the page
accounting) with the head's KV at position i written once token i + 1 is known:

  - mirror, after each target forward: the features of every token it computed go to
    `features` (a row per KV slot, in the target's page ids), then the head runs over the
    same tokens one position back (token i at position i - 1, with feature i - 1): a chunk
    at positions [p, q] writes the head's KV of [p - 1, q - 1], except position -1, and
    except the first position of a verify chunk, which propose wrote;
  - propose, before a verify forward at positions [s, s + k]: step 0 runs the head at s - 1
    with the chunk's first token and feature s - 1 (computed by the target), then each step
    j at s - 1 + j with draft j and the head's own output of step j - 1 as the feature: k
    steps for k proposals. The KV of steps 1.. is the head's guess; mirror rewrites it from
    the target's features, for the positions the verify keeps.

Invariants:
  - the head's KV at every position i < the next verify's start - 1 of a running request
    equals a fresh head prefill's over (tokens 1..i + 1, target features 0..i), but for a
    page shared through the radix tree, whose last position holds the KV computed with the
    next token of the request that computed it last (the acceptance may differ, never the
    output);
  - features[slot] is the target's feature of the token whose KV the slot holds (it goes with
    the page: cached prefixes keep theirs);
  - propose's steps replay the head's decode graphs on CUDA (its features copied into their
    static buffer first); mirror runs the head eagerly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from streamer.errors import ConfigError
from streamer.messages import Batch, SeqChunk
from streamer.model.draft import DraftModel
from streamer.model.graphs import ladder
from streamer.model.layers import Linear
from streamer.model.llama import LlamaForCausalLM
from streamer.model.loader import load_model, read_tensor
from streamer.model.packing import prepare


class EagleDraft(DraftModel):
    steps_after = 0
    shift = -1

    def __init__(self, model_path: str, *, target: Any, target_cfg: Any, target_path: str, config: Any,
                 device: torch.device, max_model_len: int, kv_dtype: torch.dtype) -> None:
        where = f"speculative_config model {model_path}"
        self.method = config.speculative_config.method
        if type(target).forward is not LlamaForCausalLM.forward:
            raise ConfigError(f"{where}: EAGLE heads read the hidden states of {type(target).__name__}'s layers, "
                              "which it does not return yet (the Llama-family decoders do)")
        super().__init__(model_path, target_cfg=target_cfg, config=config, device=device,
                         max_model_len=max_model_len, kv_dtype=kv_dtype)
        head = self.model
        if head.target_hidden_size != int(target_cfg.hidden_size):
            raise ConfigError(f"{where}: the head reads features of {head.target_hidden_size} values, the target's "
                              f"hidden size is {target_cfg.hidden_size}: it was trained for another model")
        whole = target.tp is not None and config.load_format != "dummy"
        """(each rank holds a slice of the target's embeddings and LM head: rank 0's head, which
        runs alone, reads whole copies from the checkpoint)"""
        if not head.own_embeddings:  # (no embed_tokens in the checkpoint: the target's)
            if int(head.config.hidden_size) != int(target_cfg.hidden_size):
                raise ConfigError(f"{where}: the head has no embeddings of its own and its hidden size "
                                  f"{head.config.hidden_size} is not the target's {target_cfg.hidden_size}")
            if target.tp is None:
                head.embed_tokens = target.embed_tokens
            elif whole:
                weight = read_tensor(Path(target_path), "model.embed_tokens.weight")
                head.embed_tokens.weight.data.copy_(weight.to(head.embed_tokens.weight.dtype))
        if head.shares_lm_head:
            if target.tp is None:
                head.lm_head = target.lm_head
            else:
                head.lm_head = Linear(int(target_cfg.hidden_size), int(target_cfg.vocab_size), bias=False).to(
                    device=device, dtype=head.fc.weight.dtype)
                if whole:
                    tied = bool(getattr(target_cfg, "tie_word_embeddings", False))
                    weight = read_tensor(Path(target_path), "model.embed_tokens.weight" if tied else "lm_head.weight")
                    head.lm_head.weight.data.copy_(weight.to(head.lm_head.weight.dtype))
                else:
                    head.lm_head.weight.data.normal_(0.0, 0.02)
        target.aux_layers = head.target_layers(int(target_cfg.num_hidden_layers), where)
        # (the rows of any step that a CUDA graph runs: mirror reads them before the next forward)
        rows = max(int(config.max_num_batched_tokens), int(config.max_num_seqs))
        target.aux_out = torch.empty(rows, len(target.aux_layers) * int(target_cfg.hidden_size),
                                     dtype=target.embed_tokens.weight.dtype, device=device)
        self.target = target
        self.features: torch.Tensor | None = None
        """[pages * page_size, hidden]: the head's input feature of each KV slot's token."""
        self.prenorm: torch.Tensor | None = None
        """The head's outputs of propose's last step (its features for the next)."""
        self.feature_buf = torch.zeros(0)
        """With CUDA graphs: the static features of propose's steps (the graphs read them)."""

    def load(self, model_path: str, config: Any, device: torch.device, max_model_len: int) -> tuple[Any, Any]:
        return load_model(model_path, dtype=config.dtype, device=device, load_format=config.load_format,
                          max_positions=max_model_len, seed=config.seed + 1, draft_head=self.method)

    def bytes_per_page(self, page_size: int) -> int:
        return super().bytes_per_page(page_size) + page_size * self.cfg.hidden_size * self.model.fc.weight.element_size()

    def make_pool(self, num_pages: int, page_size: int, graphs_bs: int = 0, max_pages: int = 0) -> None:
        """The head's KV and features under the target's page ids; with graphs_bs, propose's
        steps captured up to that batch size, their features read from one static buffer."""
        dtype = self.model.fc.weight.dtype
        self.features = torch.zeros(num_pages * page_size, self.cfg.hidden_size, dtype=dtype, device=self.device)
        if graphs_bs:
            self.feature_buf = torch.zeros(ladder(graphs_bs)[-1], self.cfg.hidden_size, dtype=dtype, device=self.device)
            self.model.feature = self.feature_buf
        super().make_pool(num_pages, page_size, graphs_bs, max_pages)

    def page_parts(self) -> list[torch.Tensor]:
        """The head's KV and its features of each page's tokens."""
        assert self.pool is not None and self.features is not None
        return [*super().page_parts(), self.features.view(torch.uint8).view(1, self.pool.num_pages, -1)]

    def release(self) -> None:
        super().release()
        self.features = self.prenorm = None
        self.feature_buf = torch.zeros(0)
        self.target = None

    @torch.inference_mode()
    def mirror(self, batch: Batch, x: dict[str, Any]) -> None:
        """Keep the features of the tokens the target just computed, then write the head's KV
        one position back of each (see the module's docstring)."""
        assert self.pool is not None and self.features is not None
        n = x["input_ids"].shape[0]
        self.features[x["slot_mapping"]] = self.model.target_feature(self.target.aux_hidden[:n])
        chunks: list[SeqChunk] = []
        row = 0
        for s in batch.seqs:
            length = len(s.token_ids)
            first = 1 if s.start == 0 or s.num_draft else 0
            if length > first:
                # the chunk's "tokens" are the rows of x whose ids it takes: they travel in
                # prepare's one upload
                chunks.append(SeqChunk(s.request_id, list(range(row + first, row + length)), s.start - 1 + first,
                                       s.page_table, False))
            row += length
        if not chunks:
            return
        xd = prepare(Batch(batch.step, chunks, [], [], []), page_size=self.pool.page_size, device=self.device,
                     staging=self.staging, graphs=None, extend_graphs=None, split_decode_tokens=1 << 62,
                     last_tokens=x["input_ids"][:0], last_rows={})
        xd["input_ids"] = x["input_ids"][xd["input_ids"]]
        self.model.feature = self.features[xd["slot_mapping"]]
        self._run(xd)

    def _step_logits(self, x: dict[str, Any], j: int, prev_rows: list[int]) -> torch.Tensor:
        n = x["n_sample"]  # (one token per chunk: rows 0..n-1)
        if j == 0:
            assert self.features is not None
            feature = self.features[x["slot_mapping"]]
        else:
            assert self.prenorm is not None
            feature = self.prenorm
            if prev_rows != list(range(len(prev_rows))) or len(prev_rows) != feature.shape[0]:
                # (from pinned memory: a pageable copy would wait for the stream's work so far)
                rows = torch.tensor(prev_rows)
                if feature.is_cuda:
                    rows = rows.pin_memory().to(self.device, non_blocking=True)
                feature = feature[rows]
        if x["graph"] is not None:
            self.feature_buf[:n].copy_(feature)
            logits = x["graph"].replay(x)  # (it sets the head's prenorm to its static rows)
            self.prenorm = self.model.prenorm
            return logits
        self.model.feature = feature
        hidden = self._run(x)
        self.prenorm = self.model.prenorm[:n]
        return self.model.compute_logits(hidden[:n])
