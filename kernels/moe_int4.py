"""`fused_moe_int4`: the mixture-of-experts MLP of kernels/moe.py with 4-bit experts (W4A16),
each expert's weights in kernels/int4.py's layout, stacked:

    gate_up  qweight int32 [E, 2I, H / 8], scales [E, 2I, H / G1] (x's dtype), zeros uint8 [E, 2I, H / G1]
    down     qweight int32 [E, H, I / 8],  scales [E, H, I / G2],              zeros uint8 [E, H, I / G2]

(each expert's gate rows, then its up rows, as the bf16 experts). The same alignment
(kernels/moe_align.py), the same two grouped GEMMs and the same combine as kernels/moe.py,
except that each K tile of the expert's weights is dequantized in the loop (kernels/int4.py's
`_dequant_tile`, rounded to x's dtype as `dequantize` gives the reference) before its
tensor-core dot. Up to GEMV_TOKENS tokens, two GEMV kernels replace the alignment and the grouped
GEMMs (each (token, slot) pair streams its expert's rows, as kernels/moe_gemv.py does for bf16 experts)
and feed the same combine. Semantics: kernels.reference_moe.fused_moe on the dequantized experts
(`reference`), with its roundings (kernels/moe.py's docstring). groups = (G1, G2): consecutive
columns per scale and zero of each projection (a checkpoint's group size, or a whole row: H and
I). The K tile divides the group (one scale and zero per row in a tile), so H must be a multiple
of G1, I of G2, and both groups of 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference_moe
from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import round_to as _round_to
from kernels.int4 import _block_k, _dequant_tile, dequantize, unroll
from kernels.moe import MoeConfig, _combine_kernel, default_config, down_store, gate_up_store
from kernels.moe_align import align_pairs
from kernels.moe_operands import act_constants, bias_operand

GEMV_TOKENS = 4
"""Tokens up to which the GEMV kernels replace the alignment and the grouped GEMMs: on the H100, the Qwen3-30B-A3B
layer took 23.5 us at one token against the grouped GEMMs' 34.1, 71.7 against 74.0 at 4, but 130 against 110 at 8
(benchmarks/moe_layer.py --int4, thirty-second session)."""

GEMV = (16, 4)
"""The GEMV kernels' (BLOCK_N, num_warps), the fastest of six at 1 to 16 tokens in the same measurement (each K
tile up to 256 columns within a group, up to 4 of them per loop iteration for gate_up, 8 for down)."""


@triton.jit
def _int4_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, sorted_ptr, expert_ptr, bias_ptr,
    PAIRS, PADDED, H, INTER, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    G: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr,
    PERM: tl.constexpr = False,
):
    """inter[r, n] = act(x[p // k] . Wg_e[n] + bg_e[n]) * (x[p // k] . Wu_e[n] + bu_e[n]) for one
    M-block (expert e) and BLOCK_N columns, W dequantized tile by tile (kernels/moe.py's GEMM 1).
    PERM: the expert's K is stored in its act order, perm [E, H]: column k of W is x's column
    perm[e, k] (the x tile gathered by it)."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert >= E:  # past the last group
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m, mask=offs_m < PADDED, other=PAIRS)
    valid = pair < PAIRS
    tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    gate_rows = tl.minimum(offs_n, INTER - 1)  # (tail rows re-read a valid row; the store masks them)
    up_rows = gate_rows + INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
    w_e, s_e, z_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        if PERM:
            cols = tl.load(perm_ptr + expert * H + k + offs_k)
            a = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs + k, mask=valid[:, None], other=0.0)
        wg = _round_to(_dequant_tile(w_e, s_e, z_e, gate_rows, k, stride_wn, stride_sn, G, BLOCK_N, BLOCK_K), DTYPE,
                       INTERP)
        wu = _round_to(_dequant_tile(w_e, s_e, z_e, up_rows, k, stride_wn, stride_sn, G, BLOCK_N, BLOCK_K), DTYPE,
                       INTERP)
        a = a.to(COMPUTE)
        acc_g = tl.dot(a, tl.trans(wg.to(COMPUTE)), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.trans(wu.to(COMPUTE)), acc_u, input_precision=PRECISION)
    gate_up_store(acc_g, acc_u, expert, offs_m, offs_n, n_mask, valid, bias_ptr, out_ptr, stride_o, INTER, ACT, ALPHA,
                  LIMIT, HAS_BIAS, DTYPE, INTERP)


@triton.jit
def _int4_down_kernel(
    h_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, sorted_ptr, expert_ptr, weight_ptr, bias_ptr,
    PAIRS, PADDED, H, INTER, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    G: tl.constexpr, E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr, DTYPE: tl.constexpr,
    INTERP: tl.constexpr, PERM: tl.constexpr = False,
):
    """out[p, n] = topk_weight[p] * (inter[r] . Wd_e[n] + bd_e[n]) (float32), p = sorted_ids[r]
    (kernels/moe.py's GEMM 2, W dequantized tile by tile; PERM: perm [E, I], as GEMM 1's)."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert >= E:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m, mask=offs_m < PADDED, other=PAIRS)
    valid = pair < PAIRS
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    rows = tl.minimum(offs_n, H - 1)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + offs_m[:, None] * stride_h + offs_k[None, :]
    w_e, s_e, z_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, INTER, BLOCK_K):
        if PERM:
            cols = tl.load(perm_ptr + expert * INTER + k + offs_k)
            a = tl.load(h_ptr + offs_m[:, None] * stride_h + cols[None, :], mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs + k, mask=valid[:, None], other=0.0)
        w = _round_to(_dequant_tile(w_e, s_e, z_e, rows, k, stride_wn, stride_sn, G, BLOCK_N, BLOCK_K), DTYPE, INTERP)
        acc = tl.dot(a.to(COMPUTE), tl.trans(w.to(COMPUTE)), acc, input_precision=PRECISION)
    down_store(acc, expert, pair, offs_n, n_mask, valid, bias_ptr, weight_ptr, out_ptr, stride_o, H, HAS_BIAS, DTYPE,
               INTERP)


@triton.jit
def _pair_block(ids_ptr, N, BLOCK_N: tl.constexpr):
    """The GEMVs' program (pair p, n-block): p, its expert, the block's BLOCK_N output rows, which of them
    are < N, and the rows clamped to N - 1 (tail rows re-read a valid row; the stores mask them)."""
    p = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return p, tl.load(ids_ptr + p).to(tl.int64), offs_n, offs_n < N, tl.minimum(offs_n, N - 1)


@triton.jit
def _int4_gemv_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, ids_ptr, out_ptr, bias_ptr,
    H, INTER, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    G: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr, INTERP: tl.constexpr, PERM: tl.constexpr,
):
    """GEMM 1 for a few tokens: program (pair p, n-block) streams BLOCK_N gate and up rows of
    expert ids[p] with elementwise FMAs (kernels/int4.py's GEMV), no alignment: inter[p] as the
    grouped kernel's, through the same epilogue."""
    p, expert, offs_n, n_mask, gate_rows = _pair_block(ids_ptr, INTER, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (p // TOPK) * stride_x
    w_e, s_e, z_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):  # (kernels/int4.py's GEMV: UNROLL tiles' words in flight)
            k = k0 + u * BLOCK_K
            cols = tl.load(perm_ptr + expert * H + k + offs_k) if PERM else k + offs_k
            xv = tl.load(x_row + cols[None, :] + (offs_n * 0)[:, None]).to(tl.float32)  # (in W's layout: L1 hits)
            wg = _round_to(_dequant_tile(w_e, s_e, z_e, gate_rows, k, stride_wn, stride_sn, G, BLOCK_N, BLOCK_K),
                           DTYPE, INTERP)
            wu = _round_to(_dequant_tile(w_e, s_e, z_e, gate_rows + INTER, k, stride_wn, stride_sn, G, BLOCK_N,
                                         BLOCK_K), DTYPE, INTERP)
            acc_g += wg.to(tl.float32) * xv
            acc_u += wu.to(tl.float32) * xv
    one = tl.full([1], 0, tl.int64) + p
    gate_up_store(tl.sum(acc_g, axis=1)[None, :], tl.sum(acc_u, axis=1)[None, :], expert, one, offs_n, n_mask,
                  one >= 0, bias_ptr, out_ptr, stride_o, INTER, ACT, ALPHA, LIMIT, HAS_BIAS, DTYPE, INTERP)


@triton.jit
def _int4_gemv_down_kernel(
    h_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, ids_ptr, weight_ptr, out_ptr, bias_ptr,
    H, INTER, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr, INTERP: tl.constexpr, PERM: tl.constexpr,
):
    """GEMM 2 for a few tokens: program (pair p, n-block), y[p] as the grouped kernel's."""
    p, expert, offs_n, n_mask, rows = _pair_block(ids_ptr, H, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_row = h_ptr + p * stride_h
    w_e, s_e, z_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            k = k0 + u * BLOCK_K
            cols = tl.load(perm_ptr + expert * INTER + k + offs_k) if PERM else k + offs_k
            hv = tl.load(h_row + cols[None, :] + (offs_n * 0)[:, None]).to(tl.float32)
            w = _round_to(_dequant_tile(w_e, s_e, z_e, rows, k, stride_wn, stride_sn, G, BLOCK_N, BLOCK_K), DTYPE,
                          INTERP)
            acc += w.to(tl.float32) * hv
    one = tl.full([1], 0, tl.int64) + p
    down_store(tl.sum(acc, axis=1)[None, :], expert, one, offs_n, n_mask, one >= 0, bias_ptr, weight_ptr, out_ptr,
               stride_o, H, HAS_BIAS, DTYPE, INTERP)


Int4Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(qweight, scales, zeros) of stacked int4 experts (the module docstring's layout)."""


def _check(x: torch.Tensor, gate_up: Int4Experts, down: Int4Experts, groups: tuple[int, int]) -> tuple[int, int, int]:
    (qg, sg, zg), (qd, sd, zd) = gate_up, down
    experts, two_i, hidden = qg.shape[0], qg.shape[1], x.shape[1]
    inter = two_i // 2
    g1, g2 = groups
    assert g1 % 16 == 0 and g2 % 16 == 0 and hidden % g1 == 0 and inter % g2 == 0, (groups, hidden, inter)
    assert qg.shape == (experts, 2 * inter, hidden // 8) and qd.shape == (experts, hidden, inter // 8)
    assert sg.shape == zg.shape == (experts, 2 * inter, hidden // g1)
    assert sd.shape == zd.shape == (experts, hidden, inter // g2)
    assert qg.dtype == qd.dtype == torch.int32 and zg.dtype == zd.dtype == torch.uint8
    assert sg.dtype == sd.dtype == x.dtype and x.dtype in _TL_DTYPES
    return experts, hidden, inter


def reference(x: torch.Tensor, gate_up: Int4Experts, down: Int4Experts, groups: tuple[int, int],
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
              perms: tuple[torch.Tensor, torch.Tensor] | None = None, **kw) -> torch.Tensor:
    """kernels.reference_moe.fused_moe on the experts dequantized to x's dtype (kernels.int4.dequantize);
    with perms ([E, H], [E, I]: each expert's act order), stored column k of an expert's W is
    its input's column perm[e, k]."""
    _check(x, gate_up, down, groups)

    def full(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int, perm: torch.Tensor | None) -> torch.Tensor:
        e, n = q.shape[:2]
        w = dequantize(q.reshape(e * n, -1), s.reshape(e * n, -1), z.reshape(e * n, -1), group, x.dtype).view(e, n, -1)
        if perm is None:
            return w
        return torch.empty_like(w).scatter_(2, perm.long()[:, None, :].expand_as(w), w)  # W[:, perm[k]] = stored[:, k]

    p_gu, p_d = perms if perms is not None else (None, None)
    return reference_moe.fused_moe(x, full(*gate_up, groups[0], p_gu), full(*down, groups[1], p_d), topk_weights,
                                   topk_ids, activation, **kw)


def _grouped(x, gate_up: Int4Experts, down: Int4Experts, perms, groups: tuple[int, int], topk_ids: torch.Tensor,
             weights: torch.Tensor, y: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor],
             has_bias: tuple[bool, bool], cfg: MoeConfig, act: dict, permuted: bool) -> None:
    """The alignment and the two grouped GEMMs, y [pairs, H] (float32, weighted) filled."""
    (qg, sg, zg), (qd, sd, zd) = gate_up, down
    experts, hidden, inter, topk = qg.shape[0], x.shape[1], qd.shape[2] * 8, topk_ids.shape[1]
    pairs = y.shape[0]
    sorted_ids, block_expert = align_pairs(topk_ids, experts, cfg.block_m)
    blocks = block_expert.numel()
    dtype, interp = _TL_DTYPES[x.dtype], _interpreting()
    # (the interpreter's bf16 tl.dot is wrong: it multiplies in float32 there, an exact widening)
    compute = tl.float32 if interp or x.dtype == torch.float32 else dtype
    precision = "ieee" if compute == tl.float32 else "tf32"
    tiles = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    h = torch.empty((sorted_ids.numel(), inter), dtype=x.dtype, device=x.device)
    _int4_gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        x, qg, sg, zg, perms[0], h, sorted_ids, block_expert, biases[0],
        pairs, sorted_ids.numel(), hidden, inter, x.stride(0), qg.stride(0), qg.stride(1), sg.stride(0), sg.stride(1),
        h.stride(0),
        G=groups[0], BLOCK_K=_block_k(groups[0], cfg.block_k), TOPK=topk, E=experts, **act,
        HAS_BIAS=has_bias[0], COMPUTE=compute, PRECISION=precision, DTYPE=dtype, INTERP=interp,
        PERM=permuted, **tiles,
    )  # fmt: skip
    _int4_down_kernel[(blocks, triton.cdiv(hidden, cfg.block_n))](
        h, qd, sd, zd, perms[1], y, sorted_ids, block_expert, weights, biases[1],
        pairs, sorted_ids.numel(), hidden, inter, h.stride(0), qd.stride(0), qd.stride(1), sd.stride(0), sd.stride(1),
        y.stride(0),
        G=groups[1], BLOCK_K=_block_k(groups[1], cfg.block_k), E=experts, HAS_BIAS=has_bias[1],
        COMPUTE=compute, PRECISION=precision, DTYPE=dtype, INTERP=interp, PERM=permuted, **tiles,
    )  # fmt: skip


def fused_moe_int4(
    x: torch.Tensor,
    gate_up: Int4Experts,
    down: Int4Experts,
    groups: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    config: MoeConfig | None = None,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = reference_moe.SWIGLU_ALPHA,
    swiglu_limit: float = reference_moe.SWIGLU_LIMIT,
    perms: tuple[torch.Tensor, torch.Tensor] | None = None,
    gemv: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`reference` on the GPU (or the interpreter): x [T, H] -> [T, H] in x's dtype; no host
    synchronisation (CUDA-graph capturable). config: the grouped GEMMs' tiles (default kernels.moe's
    default_config for int4 experts: this card's measured table or the built-in rules, the K tile cut
    to divide the group). gemv: (BLOCK_N, num_warps) of the GEMV kernels,
    which replace the alignment and the grouped GEMMs (default for up to GEMV_TOKENS tokens without a
    config). perms: int32 [E, H] and [E, I], each expert's act order."""
    experts, hidden, inter = _check(x, gate_up, down, groups)
    t, topk = x.shape[0], topk_ids.shape[1]
    pairs = t * topk
    if pairs == 0:
        return torch.zeros_like(x)
    act = act_constants(activation, swiglu_alpha, swiglu_limit)
    x = x.contiguous()
    b_gu = bias_operand(w_gate_up_bias, (experts, 2 * inter), x)
    b_d = bias_operand(w_down_bias, (experts, hidden), x)
    has_bias = (w_gate_up_bias is not None, w_down_bias is not None)
    (qg, sg, zg), (qd, sd, zd) = (tuple(a.contiguous() for a in gate_up), tuple(a.contiguous() for a in down))
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    dtype, interp = _TL_DTYPES[x.dtype], _interpreting()
    if perms is not None:
        assert perms[0].shape == (experts, hidden) and perms[1].shape == (experts, inter)
        assert perms[0].dtype == perms[1].dtype == torch.int32
    p_gu, p_d = (p.contiguous() for p in perms) if perms is not None else (x, x)  # (x: unread placeholders)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    if gemv is None and config is None and t <= GEMV_TOKENS:
        gemv = GEMV
    if gemv is not None:
        bn, warps = gemv
        bk_gu, bk_d = _block_k(groups[0], 256), _block_k(groups[1], 256)
        ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
        _int4_gemv_gate_up_kernel[(pairs, triton.cdiv(inter, bn))](
            x, qg, sg, zg, p_gu, ids, h, b_gu,
            hidden, inter, x.stride(0), qg.stride(0), qg.stride(1), sg.stride(0), sg.stride(1), h.stride(0),
            G=groups[0], TOPK=topk, BLOCK_N=bn, BLOCK_K=bk_gu, UNROLL=unroll(hidden, bk_gu, 4), **act,
            HAS_BIAS=has_bias[0], DTYPE=dtype, INTERP=interp, PERM=perms is not None,
            num_warps=warps, num_stages=1,
        )  # fmt: skip
        _int4_gemv_down_kernel[(pairs, triton.cdiv(hidden, bn))](
            h, qd, sd, zd, p_d, ids, weights, y, b_d,
            hidden, inter, h.stride(0), qd.stride(0), qd.stride(1), sd.stride(0), sd.stride(1), y.stride(0),
            G=groups[1], BLOCK_N=bn, BLOCK_K=bk_d, UNROLL=unroll(inter, bk_d), HAS_BIAS=has_bias[1],
            DTYPE=dtype, INTERP=interp, PERM=perms is not None, num_warps=warps, num_stages=1,
        )  # fmt: skip
    else:
        _grouped(x, (qg, sg, zg), (qd, sd, zd), (p_gu, p_d), groups, topk_ids, weights, y, (b_gu, b_d), has_bias,
                 config or default_config(pairs, experts, hidden, inter, "int4", x.device), act, perms is not None)
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    _combine_kernel[(t, triton.cdiv(hidden, 1024))](y, out, hidden, TOPK=topk, BLOCK=1024, DTYPE=dtype, INTERP=interp)
    return out
