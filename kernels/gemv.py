"""Triton GEMV for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 4 (a few tokens).

Why not cuBLAS: at M = 1..4 a linear layer is a pure stream of W, and cuBLAS
picks GEMM tilings that leave most of the H200's bandwidth unused on mid-size
weights (1.8 TB/s on 4096x4096 where a copy reaches 4.25 TB/s). Decode time is
the sum of these streams, so each layer should read W once, as fast as the
memory allows.

Layout of the work: one program owns BLOCK_N rows of W (row-major [N, K], an
nn.Linear weight) and walks K in BLOCK_K chunks, loads coalesced along K.
All M rows of x are handled in the same program (one fp32 accumulator per row),
so W is read exactly once whatever M. The accumulators are [BLOCK_N, BLOCK_K]
tiles (elementwise FMAs, no tl.dot: at M <= 4 tensor cores buy nothing and the
interpreter gets bf16 dots wrong) reduced along K once at the end; UNROLL
chunks are loaded per iteration so more bytes are in flight per warp without
growing the accumulators.

When N / BLOCK_N programs are too few to keep every SM streaming (small N * K,
e.g. Qwen3-0.6B's o and down projections, N = 1024), K is split over a second grid axis: each split writes
fp32 partial sums to a workspace and a tiny second kernel adds the splits in a
fixed order, so results are deterministic (no atomics) and CUDA-graph safe.

Configs are fixed per (M, N, K) by `gemv_config` (no autotuning at run time: the
engine captures CUDA graphs, and benchmarking inside a capture is not
possible); benchmarks/gemv_bench.py sweeps alternatives to tune it.

`gemv_glu` fuses SwiGLU into the gate_up projection at M = 1: each program
streams gate rows and the up rows that pair with them and applies silu(gate) *
up in its epilogue, which saves the silu_and_mul launch and its round trip. (The
activation fused into the down projection's x loads instead was slower on the
H200, 38.0 against 30.1 us: every program recomputed the activations of its K
range; it was removed.)

On sm_90 the kernels are launched with programmatic dependent launch (see
kernels.common.pdl_enabled). Prefetching the first 1,024 columns of each
program's W rows into L2 before the PDL wait was slower: W2 went from 4.17 to
4.34 ms/token (2,048 columns: 4.44), the prefetches competing with the previous
kernel for the bandwidth; it was removed.

Rows past N or M are clamped to the last valid row for loads (no masks in the
hot loop) and masked at the store; K is masked only when a split's range is not
a multiple of BLOCK_K * UNROLL. Under TRITON_INTERPRET (CPU tensors, tests)
bf16 roundings are done by hand because the interpreter truncates casts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import pdl_enabled as _pdl_enabled
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import round_to as _round_to

MAX_M = 4  # rows of x per program; larger M is split over a third grid axis


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters. split_k is an upper bound: K is cut in chunks that are
    multiples of block_k * unroll, so fewer splits may run."""

    block_n: int = 4
    block_k: int = 256
    unroll: int = 4
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    acc_1d: bool = False  # reduce along K every chunk (small accumulators) instead of once at the end

    def __str__(self) -> str:
        s = f"n{self.block_n}k{self.block_k}u{self.unroll}s{self.split_k}w{self.num_warps}"
        return s + (f"st{self.num_stages}" if self.num_stages != 1 else "") + ("r" if self.acc_1d else "")

    def with_(self, **kw) -> GemvConfig:
        return replace(self, **kw)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # H200: keeps the CPU (interpreter) choice equal to the GPU one
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def gemv_config(m: int, n: int, k: int, sms: int = 132, w_bytes: int = 2) -> GemvConfig:
    """The config used when none is given (w_bytes: the size of one element of W).

    Plain: 4 rows x 256 columns per chunk with 4 warps, so a warp holds one W
    row and each thread 8 consecutive elements (one 16-byte load) per chunk;
    with a thread on a single row, its x loads are not duplicated across rows.
    Four chunks are loaded per iteration (2 KB in flight per warp) while the
    accumulators stay at 8 fp32 per x row (~40 registers at M = 1, ~90 at 4).
    K is split (power of two, each split at least 1024 long)
    until there are 4 programs per SM, the occupancy that keeps enough loads
    in flight. A float8 W takes 512 columns per chunk by default, so that each thread
    still loads 16 bytes at once and a chunk moves the same bytes as a bf16 one.
    """
    cfg = GemvConfig(block_k=256 * 2 // w_bytes)
    if m == 1 and 4096 <= n <= 32768:
        # measured on the H200 (benchmarks/gemv_bench.py): 16 rows and 8 warps stream
        # Llama-3.1-8B's qkv, o and gate_up 1-3% faster than 4 rows and 4 warps, unsplit
        cfg = cfg.with_(block_n=16, num_warps=8)
        if w_bytes == 1:
            # float8 (gemv_bench.py --only fp8): the bytes in flight per program that stream
            # best shrink as programs per SM grow. gate_up (13.6 per SM): 256 x 2 columns per
            # step, 30.2 against 33.2 us with 512 x 4; qkv (2.9): 512 x 4; o and down (1.9):
            # 512 x 8 (o, 5.8 against 7.1 us) or, where 4,096 does not divide K, 1024 x 2
            # (down, 16.5 against 20.2 us)
            per_sm = triton.cdiv(n, cfg.block_n) / sms
            if per_sm >= 8:
                cfg = cfg.with_(block_k=256, unroll=2)
            elif per_sm < 2.5:
                cfg = cfg.with_(block_k=512, unroll=8) if k % 4096 == 0 else cfg.with_(block_k=1024, unroll=2)
        return cfg
    # (an LM head in 4 K-splits streamed 229 against 237 us alone in gemv_bench.py, but W2
    # went from 4.205 to 4.216 ms/token with it: the LM head stays unsplit)
    blocks = triton.cdiv(n, cfg.block_n)
    split = 1
    while blocks * split < 4 * sms and k // (2 * split) >= 1024:
        split *= 2
    return cfg.with_(split_k=split)


@triton.jit
def _x_chunk(row_ptr, offs_n, offs_k, k_left, EVEN_K: tl.constexpr):
    """x[m, k : k + BLOCK_K] as fp32, broadcastable against the [BLOCK_N, BLOCK_K] W tile.

    x is loaded straight into W's register layout, as a [BLOCK_N, BLOCK_K] tile whose
    rows share addresses (L1 hits): a 1-D load would be re-laid out through shared
    memory, with a barrier, every chunk.
    """
    ptrs = row_ptr + offs_k[None, :] + (offs_n * 0)[:, None]
    if EVEN_K:
        v = tl.load(ptrs, eviction_policy="evict_last").to(tl.float32)
    else:
        v = tl.load(ptrs, mask=(offs_k < k_left)[None, :], other=0.0, eviction_policy="evict_last")
        v = v.to(tl.float32)
    return v


@triton.jit
def _fma(acc, w, xv, ACC_1D: tl.constexpr):
    if ACC_1D:
        acc = acc + tl.sum(w * xv, axis=1)
    else:
        acc = acc + w * xv
    return acc


@triton.jit
def _finish_row(
    acc,
    m,
    M,
    N,
    offs_n,
    out_ptr,
    stride_om,
    ws_ptr,
    pid_k,
    sx_ptr,
    sw_ptr,
    rows,
    ACC_1D: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    if ACC_1D:
        y = acc
    else:
        y = tl.sum(acc, axis=1)
    if SCALED:  # float8 operands: both scales multiplied back in, in fp32 (as torch._scaled_mm)
        y = y * tl.load(sx_ptr + tl.minimum(m, M - 1)) * tl.load(sw_ptr + rows)
    mask = offs_n < tl.where(m < M, N, 0)  # (scalar & vector masks upset the interpreter)
    if SPLIT:
        tl.store(ws_ptr + (pid_k * M + m).to(tl.int64) * N + offs_n, y, mask=mask)
    else:
        tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n, _round_to(y, OUT_DTYPE, INTERP), mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    ws_ptr,
    sx_ptr,
    sw_ptr,
    M,
    N,
    K,
    k_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    ACC_1D: tl.constexpr,
    SCALED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * k_split
    k_len = tl.minimum(K - k0, k_split)
    rows = tl.minimum(offs_n, N - 1)  # tail rows re-read row N-1; the store masks them
    _pdl_enter(PDL)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm + k0
    x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm + k0
    x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm + k0
    x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm + k0
    if ACC_1D:
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k in range(0, k_split, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            kk = k + u * BLOCK_K
            if EVEN_K:
                w = tl.load(w_ptrs + kk, eviction_policy="evict_first")
            else:
                kmask = (offs_k < k_len - kk)[None, :]
                w = tl.load(w_ptrs + kk, mask=kmask, other=0.0, eviction_policy="evict_first")
            w = w.to(tl.float32)
            xa = _x_chunk(x0 + kk, offs_n, offs_k, k_len - kk, EVEN_K)
            acc0 = _fma(acc0, w, xa, ACC_1D)
            if BLOCK_M > 1:
                xa = _x_chunk(x1 + kk, offs_n, offs_k, k_len - kk, EVEN_K)
                acc1 = _fma(acc1, w, xa, ACC_1D)
            if BLOCK_M > 2:
                xa = _x_chunk(x2 + kk, offs_n, offs_k, k_len - kk, EVEN_K)
                acc2 = _fma(acc2, w, xa, ACC_1D)
            if BLOCK_M > 3:
                xa = _x_chunk(x3 + kk, offs_n, offs_k, k_len - kk, EVEN_K)
                acc3 = _fma(acc3, w, xa, ACC_1D)
    _finish_row(
        acc0, m0, M, N, offs_n, out_ptr, stride_om, ws_ptr, pid_k, sx_ptr, sw_ptr, rows, ACC_1D, SPLIT,
        SCALED, OUT_DTYPE, INTERP,
    )
    if BLOCK_M > 1:
        _finish_row(
            acc1, m0 + 1, M, N, offs_n, out_ptr, stride_om, ws_ptr, pid_k, sx_ptr, sw_ptr, rows, ACC_1D, SPLIT,
            SCALED, OUT_DTYPE, INTERP,
        )
    if BLOCK_M > 2:
        _finish_row(
            acc2, m0 + 2, M, N, offs_n, out_ptr, stride_om, ws_ptr, pid_k, sx_ptr, sw_ptr, rows, ACC_1D, SPLIT,
            SCALED, OUT_DTYPE, INTERP,
        )
    if BLOCK_M > 3:
        _finish_row(
            acc3, m0 + 3, M, N, offs_n, out_ptr, stride_om, ws_ptr, pid_k, sx_ptr, sw_ptr, rows, ACC_1D, SPLIT,
            SCALED, OUT_DTYPE, INTERP,
        )


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,
    out_ptr,
    total,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    """out.flat[i] = sum over s (in order) of ws[s].flat[i]; ws [SPLITS, M*N] fp32."""
    _pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _round_to(acc, OUT_DTYPE, INTERP), mask=mask)


@triton.jit
def _gemv_glu_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sx_ptr,
    sw_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[n] = silu(x . W[n]) * (x . W[N + n]) for one row x: W holds [gate; up] ([2N, K]).

    Each program streams BLOCK_N gate rows and the BLOCK_N up rows that pair with them,
    so the activation is applied in the epilogue, on values already in registers.
    Rounding follows the unfused path (gate_up output, silu, product: each to the
    activation dtype), so the result is what silu_and_mul(gemv(x, W)) gives."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1)  # tail rows re-read row N-1; the store masks them
    g_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + N.to(tl.int64) * stride_wn
    _pdl_enter(PDL)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            kk = k + u * BLOCK_K
            if EVEN_K:
                wg = tl.load(g_ptrs + kk, eviction_policy="evict_first")
                wu = tl.load(u_ptrs + kk, eviction_policy="evict_first")
            else:
                kmask = (offs_k < K - kk)[None, :]
                wg = tl.load(g_ptrs + kk, mask=kmask, other=0.0, eviction_policy="evict_first")
                wu = tl.load(u_ptrs + kk, mask=kmask, other=0.0, eviction_policy="evict_first")
            xv = _x_chunk(x_ptr + kk, offs_n, offs_k, K - kk, EVEN_K)
            acc_g += wg.to(tl.float32) * xv
            acc_u += wu.to(tl.float32) * xv
    g = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if SCALED:  # float8 operands: the scales of x, of the gate rows and of the up rows
        sx = tl.load(sx_ptr)
        g = g * sx * tl.load(sw_ptr + rows)
        up = up * sx * tl.load(sw_ptr + N + rows)
    g = _round_to(g, OUT_DTYPE, INTERP).to(tl.float32)
    up = _round_to(up, OUT_DTYPE, INTERP).to(tl.float32)
    s = _round_to(g / (1.0 + tl.exp(-g)), OUT_DTYPE, INTERP).to(tl.float32)
    tl.store(out_ptr + offs_n, _round_to(s * up, OUT_DTYPE, INTERP), mask=offs_n < N)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.linear(x, weight) for a few rows: x [..., K], weight [N, K] -> [..., N] in out_dtype
    (default x.dtype).

    x and weight may differ in dtype (fp32 / fp16 / bf16): both are read as fp32. With
    `scales` = (sx [M] or [M, 1], sw [N]), both operands are float8 (x quantized row by
    row, W row by row: streamer/model/quant.py) and y[m, n] = sx[m] * sw[n] * sum_k
    x[m, k] * W[n, k], what torch._scaled_mm computes; out_dtype must then be given.

    Meant for M = prod(x.shape[:-1]) <= 4 (see `use_gemv`); larger M works but
    re-reads W once per 4 rows. One or two launches, no host synchronisation.
    """
    k = x.shape[-1]
    assert weight.dim() == 2 and weight.shape[1] == k, (tuple(x.shape), tuple(weight.shape))
    assert x.dtype in _TL_DTYPES and weight.dtype in _TL_DTYPES, (x.dtype, weight.dtype)
    fp8 = scales is not None
    assert fp8 == (x.dtype == torch.float8_e4m3fn) and (out_dtype is not None or not fp8), "float8 x: scales, out_dtype"
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        return out.zero_().view(*x.shape[:-1], n)
    sx, sw = _scale_args(scales, m, n, out)
    cfg = config or gemv_config(m, n, k, _num_sms(x.device), weight.element_size())
    block_m = min(m, MAX_M)
    step = cfg.block_k * cfg.unroll
    k_split = triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), step) * step
    splits = triton.cdiv(k, k_split)
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    dtype = _TL_DTYPES[out_dtype]
    interp = _interpreting()
    pdl = _pdl_enabled(x)
    grid = (triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, block_m))
    _gemv_kernel[grid](
        x2,
        weight,
        out,
        ws,
        sx,
        sw,
        m,
        n,
        k,
        k_split,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UNROLL=cfg.unroll,
        EVEN_K=k % k_split == 0,
        SPLIT=splits > 1,
        ACC_1D=cfg.acc_1d,
        SCALED=fp8,
        OUT_DTYPE=dtype,
        INTERP=interp,
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    if splits > 1:
        total = m * n
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(total, block),)](
            ws, out, total, SPLITS=splits, BLOCK=block, OUT_DTYPE=dtype, INTERP=interp, PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )
    return out.view(*x.shape[:-1], n)


def _scale_args(scales, m: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scale vectors of a float8 call (or placeholders the kernel does not read)."""
    if scales is None:
        return like, like
    sx, sw = (s.reshape(-1) for s in scales)
    assert sx.numel() == m and sw.numel() == n, (tuple(sx.shape), tuple(sw.shape), m, n)
    assert sx.dtype == sw.dtype == torch.float32
    return sx.contiguous(), sw.contiguous()


def glu_config(n: int, k: int, w_bytes: int = 2) -> GemvConfig:
    """`gemv_glu`'s launch: block_n gate rows and as many up rows per program (so 2 * block_n
    rows in flight, like the plain kernel's 16-row tiles), 8 warps, K unsplit (N = I is
    large for every supported model). A float8 W: 256 x 2 columns per step (Llama-3.1-8B's
    gate_up, 1,792 programs: 30.2 against 34.1 us with 512 x 4; gemv_bench.py --only fp8)."""
    if w_bytes == 1:
        return GemvConfig(block_n=8, block_k=256, unroll=2, num_warps=8)
    return GemvConfig(block_n=8, num_warps=8)


def gemv_glu(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight)) for one row: x [..., K] with one row, weight [2I, K]
    holding the gate rows then the up rows (a fused gate_up_proj) -> [..., I] in out_dtype
    (default x.dtype). `scales` as in `gemv` (float8 x and W).

    At decode this saves the activation kernel's launch and its round trip through memory."""
    k = x.shape[-1]
    assert x.numel() == k, "gemv_glu: one row of x"
    assert weight.dim() == 2 and weight.shape[1] == k and weight.shape[0] % 2 == 0, (
        tuple(x.shape),
        tuple(weight.shape),
    )
    assert x.dtype in _TL_DTYPES and weight.dtype in _TL_DTYPES, (x.dtype, weight.dtype)
    fp8 = scales is not None
    assert fp8 == (x.dtype == torch.float8_e4m3fn) and (out_dtype is not None or not fp8), "float8 x: scales, out_dtype"
    n = weight.shape[0] // 2
    x1 = x.reshape(k).contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out_dtype = out_dtype or x.dtype
    out = torch.empty(n, dtype=out_dtype, device=x.device)
    if n == 0 or k == 0:
        return (out.zero_() if n else out).view(*x.shape[:-1], n)
    sx, sw = _scale_args(scales, 1, 2 * n, out)
    cfg = config or glu_config(n, k, weight.element_size())
    dtype = _TL_DTYPES[out_dtype]
    pdl = _pdl_enabled(x)
    _gemv_glu_kernel[(triton.cdiv(n, cfg.block_n),)](
        x1,
        weight,
        out,
        sx,
        sw,
        n,
        k,
        weight.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UNROLL=cfg.unroll,
        EVEN_K=k % (cfg.block_k * cfg.unroll) == 0,
        SCALED=fp8,
        OUT_DTYPE=dtype,
        INTERP=_interpreting(),
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    return out.view(*x.shape[:-1], n)


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `gemv` (or, for a fused gate_up weight, `gemv_glu`) should replace F.linear for these tensors:
    CUDA, M = 1, bf16/fp16 x, W of x's dtype or float8 (quantization "fp8", through
    streamer/model/quant.py's fp8_gemv), an nn.Linear weight contiguous along K.

    Only M = 1: on the H200 the GEMV beats cuBLAS there (Llama-3.1-8B o 11.0 against 12.5 us,
    qkv 14.0 against 15.5, down 29.0 against 31.0) but not at M = 2 or 4, where cuBLAS
    already streams W near its bandwidth and the GEMV's registers per row of x cost it.
    cuBLAS's float8 GEMM at M = 1 made Llama-3.1-8B's decode step slower than the bf16 GEMV
    (4.84 against 4.17 ms): the float8 GEMV streams half the bytes of the bf16 one."""
    if not (x.is_cuda and weight.is_cuda) or x.dim() < 1 or weight.dim() != 2:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype not in (x.dtype, torch.float8_e4m3fn):
        return False
    k = x.shape[-1]
    if k == 0 or weight.shape[1] != k or weight.shape[0] == 0:
        return False
    if weight.stride(-1) != 1:
        return False
    return x.numel() == x.shape[-1]
