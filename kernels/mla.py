"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over a paged latent cache.

The cache holds, per token and layer, one "KV head" of kv_lora_rank + rope_dim values: the
compressed kv (after kv_a_layernorm) and the rotated rope key shared by all heads. With the
absorbed formulation (streamer/model/deepseek.py) the queries are already in that space:
q [T, H, kv_lora_rank + rope_dim] is (q_nope . W_UK, q_rope), so a score is q . latent, and
the values are the latent's first kv_lora_rank dims; the output [T, H, kv_lora_rank] is
taken back to each head's v dims by W_UV (by the caller).

These are torch functions on any device: the engine's CPU path runs them whole, and they
are the oracle. On CUDA, paged_mla sends the sequences with one query token (decodes) to
the Triton kernel kernels/mla_decode.py, tested against this reference in the interpreter
only so far; prefill chunks still run here in torch, one sequence at a time: correct, not
fast. Both synchronize with the host on the lengths: no CUDA-graph capture (the models using
them say so through cuda_graphs_ok).
"""

from __future__ import annotations

import torch

from kernels.reference import gather_kv


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write latent [T, 1, D] into cache [P, S, 1, D] at slots [T] (page * S + offset); a
    slot of -1 is skipped (padding)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page_size = cache.shape[1]
    cache[slots // page_size, slots % page_size] = latent[keep].to(cache.dtype)


def paged_mla(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    kernel: bool = True,
) -> torch.Tensor:
    """Causal attention of packed latent queries over the latent cache.

    q: [T, H, D]; cache: [P, S, 1, D] (D = v_dim + rope dims); page_table: [B, max_pages];
    seq_lens: [B] context length of each sequence including its new tokens; cu_q_lens:
    [B+1] offsets of each sequence's queries in q (prefill chunks, decodes, both mixed; a
    cached prefix is the context before a sequence's queries). The i-th query of sequence b
    sits at position seq_lens[b] - q_len_b + i and sees the keys up to its own. Values are
    each key's first v_dim dims. Scores and softmax in float32 (the score is a sum over
    D = 576 products in the released models); returns [T, H, v_dim] in q's dtype.
    kernel: on CUDA, the decodes go to kernels/mla_decode.py where it takes the shapes.
    """
    t, h, d = q.shape
    out = torch.empty((t, h, v_dim), dtype=q.dtype, device=q.device)
    lens = seq_lens.tolist()
    starts = cu_q_lens.tolist()
    decodes: list[int] = []
    if kernel and q.is_cuda:
        from kernels import mla_decode

        if mla_decode.supported(q, cache, v_dim):
            decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
            if decodes:
                idx = torch.tensor(decodes, device=q.device)
                rows = cu_q_lens[idx].contiguous()
                out[rows.long()] = mla_decode.mla_decode(q, cache, page_table[idx].contiguous(),
                                                         seq_lens[idx].contiguous(), rows, scale, v_dim)
    skip = set(decodes)
    for b, length in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0 or b in skip:
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
