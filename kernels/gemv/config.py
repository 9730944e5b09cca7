"""The GEMV's dispatch and launch parameters: `use_gemv` (when it replaces F.linear) and
the configs of `gemv` and `gemv_glu` per shape, as measured on the H200."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from kernels.common import sm_count

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


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # H200: keeps the CPU (interpreter) choice equal to the GPU one
    return sm_count(device)


def gemv_config(m: int, n: int, k: int, sms: int = 132, w_bytes: int = 2) -> GemvConfig:
    """The config used when none is given (w_bytes: the size of one element of W).

    Plain: 4 rows x 256 columns per chunk with 4 warps, so a warp holds one W
    row and each thread 8 consecutive elements (one 16-byte load) per chunk;
    with a thread on a single row, its x loads are not duplicated across rows.
    Four chunks are loaded per iteration (2 KB in flight per warp) while the
    accumulators stay at 8 fp32 per x row (~40 registers at M = 1, ~90 at 4).
    K is split (power of two, each split at least 1024 long)
    until there are 3 programs per SM, the occupancy that keeps enough loads
    in flight (at 4 the Qwen3-30B-A3B shape's o, 512 blocks, was split in two with a
    reduce launch after it: W2 3.04 ms/token against 3.01 unsplit on an H100).
    A float8 W takes 512 columns per chunk by default, so that each thread
    still loads 16 bytes at once and a chunk moves the same bytes as a bf16 one.
    """
    cfg = GemvConfig(block_k=256 * 2 // w_bytes)
    if m == 1 and 4096 <= n <= 32768:
        # measured on the H200 (streamer bench gemv): 16 rows and 8 warps stream
        # Llama-3.1-8B's qkv, o and gate_up 1-3% faster than 4 rows and 4 warps, unsplit
        cfg = cfg.with_(block_n=16, num_warps=8)
        if w_bytes == 2 and k <= 8 * cfg.block_k:
            # a K of at most 2,048 in one step (the whole row in flight per program): Qwen3-30B-A3B's
            # qkv (5120 x 2048, 2.4 programs a SM) took 8.4 against 9.8 us in 4 steps of 512 x 4 on
            # the H100 (bench gemv --shapes moe.qkv --rows 1 --full)
            cfg = cfg.with_(unroll=max(cfg.unroll, triton.cdiv(k, cfg.block_k)))
        if w_bytes == 1:
            # float8 (streamer bench gemv --only fp8): the bytes in flight per program that stream
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
    # (an LM head in 4 K-splits streamed 229 against 237 us alone in streamer bench gemv, but W2
    # went from 4.205 to 4.216 ms/token with it: the LM head stays unsplit)
    blocks = triton.cdiv(n, cfg.block_n)
    split = 1
    while blocks * split < 3 * sms and k // (2 * split) >= 1024:
        split *= 2
    return cfg.with_(split_k=split)


def glu_config(n: int, k: int, w_bytes: int = 2) -> GemvConfig:
    """`gemv_glu`'s launch: block_n gate rows and as many up rows per program (so 2 * block_n
    rows in flight, like the plain kernel's 16-row tiles), 8 warps, K unsplit (N = I is
    large for every supported model). A float8 W: 256 x 2 columns per step (Llama-3.1-8B's
    gate_up, 1,792 programs: 30.2 against 34.1 us with 512 x 4; streamer bench gemv --only fp8)."""
    if w_bytes == 1:
        return GemvConfig(block_n=8, block_k=256, unroll=2, num_warps=8)
    return GemvConfig(block_n=8, num_warps=8)


def rows_per_program(cfg: GemvConfig) -> int:
    """Rows of x one program of `gemv(..., per_row=True)` takes, sharing its W tiles (each
    row's operations are the same whatever the count, so only speed depends on it): as many
    as fit in registers with M = 1's config. ptxas -v for sm_90a (Triton 3.9): bf16 chunks
    (256 x 4) hold 4 rows unspilled (214 registers with 16-row tiles); float8 256 x 2 holds
    4, 512 x 4 spills from 3 rows (140 bytes), 512 x 8 from 2 (160), 1024 x 2 already at 1
    (88) and 468 bytes at 2."""
    chunk = cfg.block_k * cfg.unroll
    if chunk <= 1024:
        return MAX_M
    return 2 if chunk <= 2048 and cfg.block_k <= 512 else 1


MAX_ROWS_PER_ROW = 16
"""Most rows `use_gemv(..., per_row=True)` takes: a verify step's num_speculative_tokens + 1."""


def use_gemv(x: torch.Tensor, weight: torch.Tensor, per_row: bool = False) -> bool:
    """True when `gemv` (or, for a fused gate_up weight, `gemv_glu`) should replace F.linear for these tensors:
    CUDA, M = 1, bf16/fp16 x, W of x's dtype or float8 (quantization "fp8", through
    streamer/model/quant.py's fp8_gemv), an nn.Linear weight contiguous along K.

    Only M = 1: on the H200 the GEMV beats cuBLAS there (Llama-3.1-8B o 11.0 against 12.5 us,
    qkv 14.0 against 15.5, down 29.0 against 31.0) but not at M = 2 or 4, where cuBLAS
    already streams W near its bandwidth and the GEMV's registers per row of x cost it.
    cuBLAS's float8 GEMM at M = 1 made Llama-3.1-8B's decode step slower than the bf16 GEMV
    (4.84 against 4.17 ms): the float8 GEMV streams half the bytes of the bf16 one.
    per_row: up to MAX_ROWS_PER_ROW rows, for gemv(..., per_row=True)."""
    if not (x.is_cuda and weight.is_cuda) or x.dim() < 1 or weight.dim() != 2:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype not in (x.dtype, torch.float8_e4m3fn):
        return False
    k = x.shape[-1]
    if k == 0 or weight.shape[1] != k or weight.shape[0] == 0:
        return False
    if weight.stride(-1) != 1:
        return False
    if per_row:  # a verify step's rows, each computed as decode's one row (gemv's per_row)
        return x.numel() <= MAX_ROWS_PER_ROW * x.shape[-1]
    return x.numel() == x.shape[-1]
