"""`fused_moe`: a mixture-of-experts MLP as two grouped GEMMs (Triton), the semantics of
kernels.reference_moe.fused_moe.

NOTE the layout. The T*k (token, slot) pairs are numbered p = t * k + j. `align_pairs`
(kernels/moe_align.py) sorts them by expert and pads each expert's group to a multiple of
BLOCK_M with the sentinel p = T*k, so that every M-block of `sorted_ids` belongs to one
expert (`block_expert`):

    sorted_ids   | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | (tail blocks: expert E) |
    block_expert |      0      |      2      |      2      |   E  (programs return)  |

The padded length is the worst case, T*k + min(E, T*k) * (BLOCK_M - 1), so the grid
needs no host synchronisation (no .item()): blocks past the last group carry expert E
and return at once. GEMM 1 gathers x rows (p // k) for each M-block, multiplies them by
the block's expert's gate and up rows (the same N columns in one program) and applies
act(gate) * up in the epilogue -> `inter` [padded, I] in sorted order. GEMM 2 multiplies
`inter` by the expert's w_down^T, scales by the routing weight and writes row p of a
float32 [T*k, H] buffer ((token, slot) order), which `_combine_kernel` sums over the slots:
a fixed summation order, for 4*T*k*H bytes (1 GiB at T 8,192, k 8, H 4,096; atomic adds
into [T, H] would save them, at the price of a run-to-run varying sum order).

Rounding follows the reference (torch ops in x.dtype): the gate and up products, the
activation, its product with up and the down product are each rounded to x.dtype; the
routing weight and the sum over slots are float32. Expert biases (gpt-oss) are added in the
GEMMs' epilogues to the rounded products, the sums rounded again (the reference's x @ W + b);
gpt-oss's clamped SwiGLU rounds after each of its steps (kernels.activation.swigluoai).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels import moe_tiles, reference
from kernels.activation import moe_glu
from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import round_to as _round_to
from kernels.moe_align import align_pairs
from kernels.moe_operands import (
    act_constants,
    bias_operand,
    fp8_operands,
    group_tile,
    quantize_groups,
    quantize_rows,
)


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Tile sizes (all >= 16, powers of two): rows per M-block (the alignment of each
    expert's group), output columns and reduction chunk per program."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for b in (self.block_m, self.block_n, self.block_k):
            assert b >= 16 and b & (b - 1) == 0, "block sizes are powers of two >= 16"


def default_config(pairs: int, experts: int, hidden: int, inter: int, kind: str = "bf16",
                   device: torch.device | None = None) -> MoeConfig:
    """The tiles measured for this card and the experts' dtype (kind: kernels/moe_tiles.py's KINDS) where a
    table exists, else by the mean rows per expert, as measured on the H200 for the Qwen3-30B-A3B layer
    (benchmarks/moe_layer.py --sweep, 2026-12-03): decode (<= 16 rows each, every expert's
    weights streamed once) 16 x 64 with 128-deep chunks, 2-4% faster than 64-deep; up to 128
    rows 64 x 64 x 64 (T 512: 7%, T 1,024: 17% faster than 32-row blocks); prefill 64 x 256 x
    64 with 8 warps (T 4,096 and 16,384: 15% faster than 64 x 64). Cut down for tiny shapes."""
    mean = pairs / max(experts, 1)
    tiles = moe_tiles.tuned(device, kind, mean) if device is not None else None
    if tiles is not None:
        bm, bn, bk, nw, ns = tiles
        cfg = MoeConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
    elif mean <= 16:
        cfg = MoeConfig(block_m=16, block_n=64, block_k=128)
    elif mean <= 128:
        cfg = MoeConfig(block_m=64, block_n=64, block_k=64)
    else:
        cfg = MoeConfig(block_m=64, block_n=256, block_k=64, num_warps=8)
    cap = max(16, triton.next_power_of_2(min(hidden, inter)))
    return replace(cfg, block_n=min(cfg.block_n, cap), block_k=min(cfg.block_k, cap))


@triton.jit
def gate_up_store(acc_g, acc_u, expert, offs_m, offs_n, n_mask, valid, bias_ptr, out_ptr, stride_o, INTER,
                  ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """GEMM 1's epilogue (also kernels/moe_int4.py's): the gate and up products rounded to DTYPE,
    the biases added to them and rounded again (the reference's x @ W + b), act(gate) * up stored."""
    g = _round_to(acc_g, DTYPE, INTERP).to(tl.float32)
    up = _round_to(acc_u, DTYPE, INTERP).to(tl.float32)
    if HAS_BIAS:
        bias = bias_ptr + expert * (2 * INTER) + offs_n
        bg = tl.load(bias, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        bu = tl.load(bias + INTER, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        g = _round_to(g + bg, DTYPE, INTERP).to(tl.float32)
        up = _round_to(up + bu, DTYPE, INTERP).to(tl.float32)
    o_ptrs = out_ptr + offs_m[:, None] * stride_o + offs_n[None, :]
    tl.store(o_ptrs, moe_glu(g, up, ACT, ALPHA, LIMIT, DTYPE, INTERP), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def down_store(acc, expert, pair, offs_n, n_mask, valid, bias_ptr, weight_ptr, out_ptr, stride_o, H,
               HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """GEMM 2's epilogue (also kernels/moe_int4.py's): the product rounded to DTYPE, plus the bias
    (rounded again), times the pair's routing weight, into the pair's float32 row."""
    y = _round_to(acc, DTYPE, INTERP).to(tl.float32)
    if HAS_BIAS:
        bd = tl.load(bias_ptr + expert * H + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = _round_to(y + bd, DTYPE, INTERP).to(tl.float32)
    w = tl.load(weight_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
    o_ptrs = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(o_ptrs, y * w[:, None], mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    sx_ptr,
    sw_ptr,
    bias_ptr,
    PAIRS,
    PADDED,
    H,
    INTER,
    stride_x,
    stride_we,
    stride_wn,
    up_off,
    stride_o,
    stride_se,
    stride_sn,
    stride_sx,
    TOPK: tl.constexpr,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """inter[r, n] = act(x[p // k] . Wg_e[n] + bg_e[n]) * (x[p // k] . Wu_e[n] + bu_e[n]),
    p = sorted_ids[r], for the BLOCK_M rows r of one M-block (one expert e) and BLOCK_N
    columns n (moe_glu: ACT, ALPHA, LIMIT; the biases b [E, 2I] with HAS_BIAS). Float8 (SCALED):
    per-row scales, or with GROUP_K (> 0) block scales, [GROUP_N, GROUP_K] blocks (x's scales
    [T, groups] at stride_sx, W's grid rows at stride_sn; the up rows' grid after the gate's)."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)  # (one per program: in bounds)
    if expert >= E:  # past the last group
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m, mask=offs_m < PADDED, other=PAIRS)  # (in bounds by the grid)
    valid = pair < PAIRS
    tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + up_off  # the up rows: INTER rows below the gate rows
    # block scales (GROUP_K): the gate row n's at grid row n // GROUP_N, the up row's past the
    # gate's ceil(INTER / GROUP_N) grid rows (each projection its own grid)
    sg_ptrs = sw_ptr + expert * stride_se + (offs_n // GROUP_N) * stride_sn
    su_ptrs = sg_ptrs + tl.cdiv(INTER, GROUP_N) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k
        a = tl.load(a_ptrs + k, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(g_ptrs + k, mask=b_mask, other=0.0)
        wu = tl.load(u_ptrs + k, mask=b_mask, other=0.0)
        if GROUP_K:  # the tile lies in group j (BLOCK_K divides GROUP_K): its product scaled, fp32
            j = k // GROUP_K
            sa = tl.load(sx_ptr + tok * stride_sx + j, mask=valid, other=0.0)[:, None]
            pg = tl.dot(a.to(COMPUTE), wg.to(COMPUTE), input_precision=PRECISION)
            pu = tl.dot(a.to(COMPUTE), wu.to(COMPUTE), input_precision=PRECISION)
            acc_g += pg * sa * tl.load(sg_ptrs + j, mask=n_mask, other=0.0)[None, :]
            acc_u += pu * sa * tl.load(su_ptrs + j, mask=n_mask, other=0.0)[None, :]
        else:
            acc_g = tl.dot(a.to(COMPUTE), wg.to(COMPUTE), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a.to(COMPUTE), wu.to(COMPUTE), acc_u, input_precision=PRECISION)
    if SCALED and GROUP_K == 0:  # float8 x (per token) and W (per row): both scales multiplied back in, fp32
        sx = tl.load(sx_ptr + tok, mask=valid, other=0.0)[:, None]
        s_ptrs = sw_ptr + expert * stride_se + offs_n
        acc_g = acc_g * sx * tl.load(s_ptrs, mask=n_mask, other=0.0)[None, :]
        acc_u = acc_u * sx * tl.load(s_ptrs + INTER, mask=n_mask, other=0.0)[None, :]
    gate_up_store(acc_g, acc_u, expert, offs_m, offs_n, n_mask, valid, bias_ptr, out_ptr, stride_o, INTER, ACT, ALPHA,
                  LIMIT, HAS_BIAS, DTYPE, INTERP)


@triton.jit
def _moe_down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    weight_ptr,
    sh_ptr,
    sw_ptr,
    bias_ptr,
    PAIRS,
    PADDED,
    H,
    INTER,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    stride_se,
    stride_sn,
    stride_sh,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """out[p, n] = topk_weight[p] * (inter[r] . Wd_e[n] + bd_e[n]) (the product rounded to
    DTYPE, then its sum with the bias [E, H] if HAS_BIAS; out float32), p = sorted_ids[r], for
    one M-block (expert e) and BLOCK_N columns. Float8 (SCALED): per-row scales, or with
    GROUP_K block scales (inter's [padded, groups] at stride_sh, W's grid rows at stride_sn)."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert >= E:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m, mask=offs_m < PADDED, other=PAIRS)  # (in bounds by the grid)
    valid = pair < PAIRS
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + offs_m[:, None] * stride_h + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = sw_ptr + expert * stride_se + (offs_n // GROUP_N) * stride_sn  # (block scales)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, INTER, BLOCK_K):
        k_mask = offs_k < INTER - k
        a = tl.load(a_ptrs + k, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs + k, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if GROUP_K:  # the tile lies in group j: its product scaled by inter's and W's block scales
            j = k // GROUP_K
            sa = tl.load(sh_ptr + offs_m * stride_sh + j, mask=valid, other=0.0)[:, None]
            part = tl.dot(a.to(COMPUTE), b.to(COMPUTE), input_precision=PRECISION)
            acc += part * sa * tl.load(s_ptrs + j, mask=n_mask, other=0.0)[None, :]
        else:
            acc = tl.dot(a.to(COMPUTE), b.to(COMPUTE), acc, input_precision=PRECISION)
    if SCALED and GROUP_K == 0:  # float8 inter (per row r) and W (per row n)
        sh = tl.load(sh_ptr + offs_m, mask=valid, other=0.0)[:, None]
        acc = acc * sh * tl.load(sw_ptr + expert * stride_se + offs_n, mask=n_mask, other=0.0)[None, :]
    down_store(acc, expert, pair, offs_n, n_mask, valid, bias_ptr, weight_ptr, out_ptr, stride_o, H, HAS_BIAS, DTYPE,
               INTERP)


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                    INTERP: tl.constexpr):
    """out[t, n] = sum over the k slots of y[t * k + j, n] (float32, slot order), in DTYPE."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j) * H + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * H + offs, _round_to(acc, DTYPE, INTERP), mask=mask)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    config: MoeConfig | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = reference.SWIGLU_ALPHA,
    swiglu_limit: float = reference.SWIGLU_LIMIT,
    block: tuple[int, int] | None = None,
    x_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """kernels.reference_moe.fused_moe on the GPU (or the interpreter): x [T, H]; w_gate_up
    [E, 2I, H]; w_down [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k] int ->
    [T, H] in x's dtype. Three small kernels align the pairs (`align_pairs`), two grouped GEMMs, one
    sum over the slots: no host synchronisation (CUDA-graph capturable).
    config: tile sizes, for tuning and tests (default: `default_config`).
    w_gate_up_scale [E, 2I], w_down_scale [E, H]: float8 experts (the reference's formula):
    x and the activation are quantized per row first, the GEMMs run on float8 tensor cores.
    With block = (bn, bk) the scales are block grids (kernels/moe_operands.py) and x and the
    activation are quantized per row and group of bk columns; the K tile then divides bk
    (`group_tile`), each tile's product scaled in fp32 before it joins the sum.
    activation "silu", "gelu_tanh" or "swigluoai" (swiglu_alpha, swiglu_limit), biases
    w_gate_up_bias [E, 2I] and w_down_bias [E, H]: the reference's; each bias is added in
    its GEMM's epilogue. x_rows: x's float8 rows and scales made by the caller (per-row experts)."""
    act = act_constants(activation, swiglu_alpha, swiglu_limit)
    t, hidden = x.shape
    experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    assert w_gate_up.shape == (experts, 2 * inter, hidden) and w_down.shape == (experts, hidden, inter)
    assert topk_weights.shape == topk_ids.shape == (t, topk)
    pairs = t * topk
    if pairs == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(pairs, experts, hidden, inter, "bf16" if w_gate_up_scale is None else "fp8",
                                          x.device)
    out_dtype = x.dtype
    b_gu = bias_operand(w_gate_up_bias, (experts, 2 * inter), x)
    b_d = bias_operand(w_down_bias, (experts, hidden), x)
    scaled, x, sx, sw_gu, sw_d = fp8_operands(x, w_gate_up_scale, w_down_scale, block,
                                              (tuple(w_gate_up.shape), tuple(w_down.shape)), x_rows)
    w_gate_up = w_gate_up.contiguous()
    w_down = w_down.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    sorted_ids, block_expert = align_pairs(topk_ids, experts, cfg.block_m)
    blocks = block_expert.numel()
    dtype = _TL_DTYPES[out_dtype]
    interp = _interpreting()
    # the interpreter's bf16 tl.dot is wrong: it multiplies in float32 there (exact widening)
    compute = tl.float32 if interp or out_dtype == torch.float32 else tl.float8e4nv if scaled else dtype
    precision = "ieee" if compute == tl.float32 else "tf32"
    group_n, group_k = block or (1, 0)
    if block is not None:
        if compute == tl.float8e4nv and group_k & -group_k < 32:
            compute = dtype  # no float8 K tile divides bk: float8 values widen exactly to x's dtype
        cfg = replace(cfg, block_k=group_tile(cfg.block_k, group_k, 32 if compute == tl.float8e4nv else 16))
    elif compute == tl.float8e4nv and cfg.block_k < 32:  # a compiled float8 tl.dot needs K >= 32
        cfg = replace(cfg, block_k=32)
    grid_rows = (sw_gu.stride(1), sw_d.stride(1)) if block is not None else (0, 0)  # (W's block grid rows)
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}

    # (the padding rows of h are never written nor read: the float8 quantization skips them)
    h = torch.empty((sorted_ids.numel(), inter), dtype=out_dtype, device=x.device)
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        x, w_gate_up, h, sorted_ids, block_expert, sx, sw_gu, b_gu,
        pairs, sorted_ids.numel(), hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), inter * w_gate_up.stride(1), h.stride(0),
        sw_gu.stride(0), grid_rows[0], sx.stride(0),
        TOPK=topk, E=experts,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_N=group_n, GROUP_K=group_k,
        **act, HAS_BIAS=w_gate_up_bias is not None, SCALED=scaled, COMPUTE=compute, PRECISION=precision,
        DTYPE=dtype, INTERP=interp, **launch,
    )  # fmt: skip
    sh = weights
    if scaled:
        live = (sorted_ids, pairs)
        h, sh = quantize_rows(h, live) if block is None else quantize_groups(h, group_k, live)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _moe_down_kernel[(blocks, triton.cdiv(hidden, cfg.block_n))](
        h, w_down, y, sorted_ids, block_expert, weights, sh, sw_d, b_d,
        pairs, sorted_ids.numel(), hidden, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0), sw_d.stride(0), grid_rows[1], sh.stride(0),
        E=experts,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_N=group_n, GROUP_K=group_k,
        HAS_BIAS=w_down_bias is not None, SCALED=scaled, COMPUTE=compute, PRECISION=precision, DTYPE=dtype,
        INTERP=interp, **launch,
    )  # fmt: skip
    out = torch.empty((t, hidden), dtype=out_dtype, device=x.device)
    _combine_kernel[(t, triton.cdiv(hidden, 1024))](y, out, hidden, TOPK=topk, BLOCK=1024, DTYPE=dtype, INTERP=interp)
    return out
