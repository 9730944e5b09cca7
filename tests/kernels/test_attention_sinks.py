"""Attention sinks (gpt-oss): one logit per query head that joins every row's softmax with a
zero value vector, out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink)). The torch reference
equals the dense definition (transformers' GptOss eager attention: concatenate the sink column,
softmax, drop it), and the decode kernel (one split, and several merged by the reduce kernel,
which alone adds the sink) and the extend kernel equal the reference, with and without a
sliding window and soft-capping (which caps the scores, not the sink).

Interpreted on CPU, compiled on CUDA (see tests/kernels/device.py): small shapes.
"""

from __future__ import annotations

import pytest
import torch

from kernels import attention, ops, reference
from tests.kernels.device import DEVICE, cuda
from tests.kernels.test_kernels import ATTN_TOL, _close, _decode_case, _extend_case

FP32_TOL = ATTN_TOL[torch.float32]
SCALE = 0.125
# (cached prefix, new tokens): a fresh prefill, one token, a chunk after a prefix, a chunk
# past a 12-token window
PREFIXES, Q_LENS = [0, 0, 26, 40], [7, 1, 20, 9]


def _sinks(h):
    """Per-head sinks around the scores' size, and the extremes: -inf (no sink at all) and one
    that outweighs every key (the output underflows towards 0, must not overflow)."""
    sinks = torch.linspace(-2.0, 4.0, h)
    sinks[0], sinks[1] = float("-inf"), 30.0
    return sinks.to(DEVICE)


def _decode_cu(q):
    return torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)


def _dense(q, k_cache, v_cache, page_table, seq_lens, cu_q_lens, scale, window, softcap, sinks):
    """The definition in float64 over every key of each sequence (read token by token through
    its page table): scores, capped, masked to i - window < j <= i; the sink column appended,
    softmax, the sink's column dropped, times V."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    h, page_size, kvh = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    for b, length in enumerate(seq_lens.tolist()):
        q0, q1 = cu_q_lens[b].item(), cu_q_lens[b + 1].item()
        j = torch.arange(length, device=q.device)
        pages = page_table[b, j // page_size].long()
        k = k_cache[pages, j % page_size].double().repeat_interleave(h // kvh, 1)  # [L, H, D]
        v = v_cache[pages, j % page_size].double().repeat_interleave(h // kvh, 1)
        s = torch.einsum("thd,jhd->thj", q[q0:q1].double(), k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(length - (q1 - q0), length, device=q.device)[:, None, None]  # query positions
        visible = j <= i
        if window > 0:
            visible &= j > i - window
        s = s.masked_fill(~visible, float("-inf"))
        sink = sinks.double()[None, :, None].expand(q1 - q0, h, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        out[q0:q1] = torch.einsum("thj,jhd->thd", p, v)
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_reference_with_sinks_equals_dense_definition(page_size):
    """Decode (one query per sequence) and chunked-extend shapes, 8 query heads over 2 KV heads,
    without and with a window and a cap; the sinks change the output."""
    q, kc, vc, pt, lens = _decode_case([1, 7, 33, 60], page_size, 4, 16, torch.float32, seed=1)
    sinks = _sinks(q.shape[1])
    cu = _decode_cu(q)
    for window, softcap in ((0, 0.0), (5, 0.0), (0, 2.0), (5, 2.0)):
        ref = reference.paged_attention(q, kc, vc, pt, lens, cu, SCALE, window, softcap, sinks=sinks)
        _close(ref, _dense(q, kc, vc, pt, lens, cu, SCALE, window, softcap, sinks), 1e-5)
    assert (ref - reference.paged_attention(q, kc, vc, pt, lens, cu, SCALE, 5, 2.0)).abs().max() > 0.1

    q, kc, vc, pt, lens, cu = _extend_case(PREFIXES, Q_LENS, page_size, 4, 16, torch.float32, seed=2)
    for window, softcap in ((0, 0.0), (12, 0.0), (0, 2.0), (12, 2.0)):
        ref = reference.paged_attention(q, kc, vc, pt, lens, cu, SCALE, window, softcap, sinks=sinks)
        _close(ref, _dense(q, kc, vc, pt, lens, cu, SCALE, window, softcap, sinks), 1e-5)
    assert (ref - reference.paged_attention(q, kc, vc, pt, lens, cu, SCALE, 12, 2.0)).abs().max() > 0.1


DECODE_CASES = [
    # page_size, window, softcap, kernel options: one split (the sink in the decode kernel's
    # epilogue); three splits (in the reduce kernel only), per-token loads and 16-token
    # sub-tiles; with a window and a cap; the split count the heuristic picks
    (1, 0, 0.0, dict(num_splits=1)),
    (16, 0, 0.0, dict(num_splits=3)),
    (16, 20, 5.0, dict(num_splits=3, subtile=True, block_n=16)),
    (1, 20, 5.0, dict(num_splits=1)),
    (16, 0, 0.0, {}),
]


@pytest.mark.parametrize("page_size,window,softcap,options", DECODE_CASES)
def test_decode_with_sinks_matches_reference(page_size, window, softcap, options):
    q, kc, vc, pt, lens = _decode_case([1, 7, 33, 100], page_size, 4, 64, torch.float32, seed=3)
    q = q * 4  # scores of a few units: the cap bites and the sinks compete with the keys
    sinks = _sinks(q.shape[1])
    out = attention.paged_decode(
        q, kc, vc, pt, lens, SCALE, window=window, softcap=softcap, sinks=sinks, **options
    )
    ref = reference.paged_attention(q, kc, vc, pt, lens, _decode_cu(q), SCALE, window, softcap, sinks=sinks)
    _close(out, ref, FP32_TOL)


EXTEND_CASES = [
    # page_size, window, softcap, kernel options: 16-query, 16-key blocks over per-token loads;
    # a window narrower than a query block and a cap over 16-token sub-tiles
    (1, 0, 0.0, dict(block_m=16, block_n=16)),
    (16, 12, 5.0, dict(subtile=True, block_n=16)),
]


@pytest.mark.parametrize("page_size,window,softcap,options", EXTEND_CASES)
def test_extend_with_sinks_matches_reference(page_size, window, softcap, options):
    q, kc, vc, pt, lens, cu = _extend_case(PREFIXES, Q_LENS, page_size, 4, 64, torch.float32, seed=4)
    q = q * 4
    sinks = _sinks(q.shape[1])
    out = attention.paged_extend(
        q, kc, vc, pt, lens, cu, SCALE, max(Q_LENS), window=window, softcap=softcap, sinks=sinks, **options
    )
    ref = reference.paged_attention(q, kc, vc, pt, lens, cu, SCALE, window, softcap, sinks=sinks)
    _close(out, ref, FP32_TOL)


def test_bf16_decode_and_tiled_extend_with_sinks():
    """bf16 queries and pages (float32 sinks): two decode splits, and the extend kernel over a
    CUDA-graph step's padded tile list."""
    q, kc, vc, pt, lens = _decode_case([7, 100], 16, 4, 64, torch.bfloat16, seed=6)
    sinks = _sinks(q.shape[1])
    ref = reference.paged_attention(q, kc, vc, pt, lens, _decode_cu(q), SCALE, 0, 5.0, sinks=sinks)
    _close(
        attention.paged_decode(q, kc, vc, pt, lens, SCALE, num_splits=2, softcap=5.0, sinks=sinks), ref, 2e-2
    )

    q, kc, vc, pt, lens, cu = _extend_case(PREFIXES, Q_LENS, 16, 4, 64, torch.bfloat16, seed=7)
    tiles = torch.from_numpy(attention.extend_tiles(Q_LENS, 16, pad_to=8)).to(DEVICE)
    out = attention.paged_extend(
        q, kc, vc, pt, lens, cu, SCALE, 32, block_m=16, tiles=tiles, window=12, sinks=sinks
    )
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, SCALE, 12, sinks=sinks), 2e-2)


def test_ops_mixed_step_passes_sinks_to_both_halves():
    """kernels.ops.paged_attention with num_decodes: the one-token sequences first (decode
    kernel on CUDA), the rest (extend kernel); on CPU both halves run the reference."""
    prefixes, q_lens = [5, 30, 0, 26], [1, 1, 7, 20]
    q, kc, vc, pt, lens, cu = _extend_case(prefixes, q_lens, 16, 4, 64, torch.float32, seed=5)
    sinks = _sinks(q.shape[1])
    out = ops.paged_attention(
        q, kc, vc, pt, lens, cu, SCALE, max(q_lens), num_decodes=2, window=12, sinks=sinks
    )
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, SCALE, 12, sinks=sinks), FP32_TOL)


@pytest.mark.cuda
@cuda
def test_cuda_graph_replay_with_new_sinks():
    """Decode (several splits: the reduce kernel reads the sinks) and extend capture in a CUDA
    graph and replay with new lengths and new sink values written into the captured tensor."""
    dtype = torch.bfloat16
    # 8 query heads in both cases: one sinks tensor serves both kernels
    q, kc, vc, pt, lens = _decode_case([100, 2000, 37, 900], 16, 4, 128, dtype, kvh=2)
    qe, kce, vce, pte, lense, cue = _extend_case(PREFIXES, Q_LENS, 16, 4, 128, dtype, seed=8)
    sinks = _sinks(q.shape[1])
    static_lens = lens.clone()

    def step():
        return (
            attention.paged_decode(q, kc, vc, pt, static_lens, SCALE, num_splits=4, sinks=sinks),
            attention.paged_extend(qe, kce, vce, pte, lense, cue, SCALE, max(Q_LENS), window=12, sinks=sinks),
        )

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up compiles outside the capture
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dec, ext = step()
    for new in ([100, 2000, 37, 900], [1, 1999, 5, 64]):  # within each sequence's pages
        static_lens.copy_(torch.tensor(new, dtype=torch.int32))
        sinks.copy_(sinks.flip(0))
        g.replay()
        torch.cuda.synchronize()
        ref = reference.paged_attention(
            q.float(), kc.float(), vc.float(), pt, static_lens, _decode_cu(q), SCALE, sinks=sinks
        )
        _close(dec, ref, ATTN_TOL[dtype])
        ref = reference.paged_attention(
            qe.float(), kce.float(), vce.float(), pte, lense, cue, SCALE, 12, sinks=sinks
        )
        _close(ext, ref, ATTN_TOL[dtype])
