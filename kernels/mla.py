"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over a paged latent cache.

The cache holds, per token and layer, one "KV head" of kv_lora_rank + rope_dim values: the
compressed kv (after kv_a_layernorm) and the rotated rope key shared by all heads. With the
absorbed formulation (streamer/model/deepseek.py) the queries are already in that space:
q [T, H, kv_lora_rank + rope_dim] is (q_nope . W_UK, q_rope), so a score is q . latent, and
the values are the latent's first kv_lora_rank dims; the output [T, H, kv_lora_rank] is
taken back to each head's v dims by W_UV (by the caller).

On CUDA, where the shapes suit them (kernels/mla_decode.py supported: power-of-two latent
and rope dims, the cache in q's dtype), paged_mla runs Triton kernels with no host
synchronisation, so a CUDA graph can capture it: a step of one query per sequence goes to the
split-KV decode kernel (kernels/mla_decode.py), any other to the extend kernel
(kernels/mla_extend.py), and a mixed step whose first num_decodes sequences are decodes sends
those to the decode kernel and the rest to the extend kernel (as kernels/ops.py
paged_attention does). store_latent writes through the Triton KV store there. Elsewhere (the
engine's CPU path, other shapes) these torch functions run whole: one sequence at a time,
synchronizing with the host on the lengths. They are the kernels' oracle
(tests/kernels/test_mla_decode.py, test_mla_extend.py).

A float8 cache (kv_cache_dtype "fp8", scale 1) holds the latent rounded to e4m3, saturated at
+-448; every path reads it back into q's dtype (the kernels) or float32 (the torch loop).
"""

from __future__ import annotations

import torch

from kernels.common import TL_DTYPES
from kernels.reference import FP8_MAX, gather_kv


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write latent [T, 1, D] into cache [P, S, 1, D] at slots [T] (page * S + offset); a
    slot of -1 is skipped (padding). On CUDA one Triton launch, no host synchronisation (the
    boolean indexing here waits for the device)."""
    if latent.is_cuda and cache.dtype in TL_DTYPES:
        from kernels import kv_store

        kv_store.store_kv(latent, None, cache, None, slot_mapping)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page_size = cache.shape[1]
    values = latent[keep]
    if cache.dtype == torch.float8_e4m3fn:  # saturated, as the Triton store's cast is (kv_cache_dtype "fp8")
        values = values.float().clamp(-FP8_MAX, FP8_MAX)
    cache[slots // page_size, slots % page_size] = values.to(cache.dtype)


def paged_mla(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    kernel: bool = True,
    max_q_len: int | None = None,
    num_decodes: int = 0,
    tiles: torch.Tensor | None = None,
    block_m: int = 0,
    split_batch: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed latent queries over the latent cache.

    q: [T, H, D]; cache: [P, S, 1, D] (D = v_dim + rope dims); page_table: [B, max_pages];
    seq_lens: [B] context length of each sequence including its new tokens; cu_q_lens:
    [B+1] offsets of each sequence's queries in q (prefill chunks, decodes, both mixed; a
    cached prefix is the context before a sequence's queries). The i-th query of sequence b
    sits at position seq_lens[b] - q_len_b + i and sees the keys up to its own. Values are
    each key's first v_dim dims. Scores and softmax in float32 (the score is a sum over
    D = 576 products in the released models); returns [T, H, v_dim] in q's dtype.

    kernel: on CUDA, the Triton kernels where they take the shapes (else this torch loop).
    For them: max_q_len, a host bound of the per-sequence query counts (1: every sequence a
    decode; None: read from cu_q_lens, which synchronizes); num_decodes: the first sequences
    have one query each and go to the decode kernel, the rest to the extend kernel; tiles and
    block_m: a CUDA-graph step's tile list (kernels/mla_extend.py); split_batch: the decode's
    split count as for a batch of this size (kernels/mla_decode.py).
    """
    if kernel and q.is_cuda:
        from kernels import mla_decode

        if mla_decode.supported(q, cache, v_dim):
            return _triton_mla(q, cache, page_table, seq_lens, cu_q_lens, scale, v_dim, max_q_len, num_decodes,
                               tiles, block_m, split_batch)
    t, h, d = q.shape
    out = torch.empty((t, h, v_dim), dtype=q.dtype, device=q.device)
    lens = seq_lens.tolist()
    starts = cu_q_lens.tolist()
    for b, length in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        ql = q1 - q0
        kv = gather_kv(cache, page_table[b], length)[:, 0].float()  # [L, D]
        scores = (q[q0:q1].float().reshape(ql * h, d) @ kv.t()).view(ql, h, length) * scale
        if ql > 1:
            qpos = torch.arange(length - ql, length, device=q.device)[:, None]
            kpos = torch.arange(length, device=q.device)[None, :]
            scores = scores.masked_fill(~(kpos <= qpos)[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = (probs.view(ql * h, length) @ kv[:, :v_dim]).view(ql, h, v_dim).to(q.dtype)
    return out


def _triton_mla(
    q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, cu_q_lens: torch.Tensor,
    scale: float, v_dim: int, max_q_len: int | None, num_decodes: int, tiles: torch.Tensor | None, block_m: int,
    split_batch: int | None,
) -> torch.Tensor:
    """paged_mla through the Triton kernels (no host synchronisation once max_q_len is given)."""
    from kernels.mla_decode import mla_decode
    from kernels.mla_extend import mla_extend

    t, h, _ = q.shape
    out = torch.empty((t, h, v_dim), dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max()) if batch else 0
    if tiles is None and 0 < num_decodes < batch:
        nd = num_decodes
        # each kernel writes its rows of `out` in place
        mla_decode(q[:nd], cache, page_table[:nd], seq_lens[:nd], scale, v_dim, split_batch=split_batch, out=out[:nd])
        mla_extend(q[nd:], cache, page_table[nd:], seq_lens[nd:], cu_q_lens[nd:] - nd, scale, v_dim, max_q_len,
                   out=out[nd:])
    elif tiles is None and max_q_len == 1:
        # (one query per sequence: q's rows are the sequences')
        mla_decode(q, cache, page_table, seq_lens, scale, v_dim, split_batch=split_batch, out=out)
    else:
        mla_extend(q, cache, page_table, seq_lens, cu_q_lens, scale, v_dim, max_q_len, tiles, block_m, out=out)
    return out
