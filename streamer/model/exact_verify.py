"""Exact verify steps: speculation's greedy output in bf16 equal to plain decoding's at ties.

A lone request's verify chunk (its last kept token and its k proposals) runs as 1 + k one-token
decode rows (`verify_rows`) through DecodeGraphs captured with rows_as_decode (`row_graphs`),
in which every row computes as batch-1 decode computes its one row: the GEMVs with M = 1's
config (kernels.gemv per_row, gemv_glu of several rows), attention split as at batch 1, the LM
head through the same GEMV (model/context.py rows_as_decode). The verified logits and the K/V
written are then plain decoding's bit for bit. `unavailable` names where that arithmetic is
not plain decoding's; speculative_config's exact_verify chooses (speculative_config.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from kernels.gemv.config import MAX_ROWS_PER_ROW
from streamer.config import EngineConfig
from streamer.errors import ConfigError
from streamer.kv.pages import PagePool
from streamer.messages import Batch
from streamer.model.context import computing_rows_as_decode
from streamer.model.experts import Experts
from streamer.model.graphs import DecodeGraphs
from streamer.model.tp_group import current as tensor_parallel

NO_GRAPHS = "needs CUDA graphs (cuda_graphs on, and a model whose steps can be captured)"


def verify_rows(batch: Batch, most: int) -> Batch | None:
    """A verify step of one sequence (its last accepted token and its proposals, nothing else) as
    that many one-token decode rows of the same sequence, one per position: each row's attention
    sees its own prefix, whose K/V the rows before it store in the same layer before any row
    attends. Run through DecodeGraphs with rows_as_decode, every row computes as a lone decode
    would, so speculation's greedy tokens are plain decoding's also in bf16 (where the extend
    step's GEMMs and attention round a near-tie the other way). None for any other step, or
    past `most` rows. The sampling rows are the same: one per position, in order."""
    if not batch.spec or len(batch.seqs) != 1:
        return None
    s = batch.seqs[0]
    n = len(s.token_ids)
    if not s.sample or s.num_draft + 1 != n or n > most or s.logprob_targets:
        return None
    rows = [msgspec.structs.replace(s, token_ids=[t], start=s.start + j, num_draft=0) for j, t in enumerate(s.token_ids)]
    return msgspec.structs.replace(batch, seqs=rows, spec=False)


def unavailable(config: EngineConfig, hf_config: Any, model: Any) -> str | None:
    """Why verify steps cannot run as decode rows here (None: they can). Each condition is
    where plain batch-1 decoding's arithmetic is not that of decode rows: wherever decode's
    one row goes through cuBLAS rather than the GEMV, rows cannot repeat its rounding."""
    assert config.speculative_config is not None
    if not config.decode_gemv:
        return "plain decoding runs cuBLAS at one row (decode_gemv is off), whose rounding rows cannot repeat"
    dtype = model.lm_head.weight.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return f"plain decoding of a {str(dtype).removeprefix('torch.')} model runs cuBLAS at one row (the GEMV " \
               "takes bfloat16 and float16), whose rounding rows cannot repeat"
    if any(getattr(m, "block", None) is not None for m in model.modules()):
        return "not with block-scaled float8 layers (cuBLAS's block-wise GEMM at every batch size)"
    if tensor_parallel() is not None:
        return "not with tensor parallelism (each rank's all-reduce)"
    if any(isinstance(m, Experts) for m in model.modules()):  # (read from the model, whatever its config calls them)
        return "not for a mixture of experts (its kernels choose their path by token count)"
    if config.speculative_config.num_speculative_tokens + 1 > MAX_ROWS_PER_ROW:
        return f"at most {MAX_ROWS_PER_ROW - 1} num_speculative_tokens"
    return None


def row_graphs(model: Any, pool: PagePool, config: EngineConfig, hf_config: Any, max_pages: int,
               memory: Any) -> DecodeGraphs | None:
    """The rows-as-decode graphs of ngram speculation (sharing the decode graphs' memory pool),
    or None where exact_verify is off or, left unset, cannot apply (refused when it is true)."""
    spec = config.speculative_config
    if spec is None or spec.method != "ngram" or spec.exact_verify is False:
        return None
    why_not = unavailable(config, hf_config, model)
    if why_not is not None:
        if spec.exact_verify:
            raise ConfigError(f"speculative_config exact_verify: {why_not}")
        return None
    graphs = DecodeGraphs(model, pool.k, pool.v, spec.num_speculative_tokens + 1, max_pages, rows_as_decode=True)
    graphs.pool = memory
    with torch.inference_mode():
        graphs.capture()
        # the LM head runs after the replay, on the real rows: its per-row GEMV compiled now for
        # every row count, not at a request's first verify step
        with computing_rows_as_decode(True):
            for b in range(2, graphs.max_bs + 1):
                model.compute_logits(graphs.hidden[next(s for s in graphs.sizes if s >= b)][:b])
    return graphs
