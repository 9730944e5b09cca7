"""Times kernels/int4.py's W4A16 layers against bf16 F.linear (cuBLAS) on Llama-3.1-8B's
shapes (group 128), after checking each against the torch reference:

    python3 benchmarks/int4_bench.py        # on a CUDA GPU
    python3 benchmarks/int4_bench.py gemv   # the GEMV's tiles at M = 1: (BLOCK_N, warps, most K tiles per iteration)
    python3 benchmarks/int4_bench.py small  # M = 2-16: the GEMM's tiles against the GEMV run per row
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import int4  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def layer(n: int, k: int, group: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=g)
    scales = (torch.rand(n, k // group, device="cuda", generator=g) * 0.004).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // group), device="cuda", generator=g).to(torch.uint8)
    return qweight, scales, zeros


def gemv_tiles() -> None:
    print(f"{torch.cuda.get_device_name()}; int4 GEMV at M = 1, us (int4 weight GB/s) per (BLOCK_N, warps, unroll)")
    for name, (n, k) in SHAPES.items():
        qweight, scales, zeros = layer(n, k)
        nbytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cells = []
        for bn, warps, unroll in ((16, 4, 1), (16, 4, 8), (16, 8, 8), (8, 4, 8), (32, 8, 8), (32, 4, 4), (64, 8, 4),
                                  (16, 4, 4), (8, 2, 8)):
            args = (x, qweight, scales, zeros, 128, (bn, 128), warps, unroll)
            us = do_bench(lambda a=args: int4.int4_gemv(*a), warmup=25, rep=100) * 1e3
            cells.append(f"({bn},{warps},{unroll}) {us:.1f} ({nbytes / us / 1e3:.0f})")
        print(f"{name} {n}x{k}: " + "; ".join(cells), flush=True)


SMALL = [(16, 32, 64, 4, 3), (16, 64, 64, 4, 3), (16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 64, 128, 8, 3),
         (16, 128, 64, 4, 3), (16, 32, 128, 4, 4), (16, 64, 64, 4, 5)]
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried at M <= 16 (the default: 16 x 64 x 64, 4 warps, 3 stages)."""


def small_m() -> None:
    print(f"{torch.cuda.get_device_name()}; int4 at M = 2-16, us: GEMV per row; GEMM (M, N, K tile, warps, stages)")
    for name, (n, k) in SHAPES.items():
        qweight, scales, zeros = layer(n, k)
        for m in (2, 4, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cells = [f"gemv {do_bench(lambda a=(x, qweight, scales, zeros, 128): int4.int4_gemv(*a)) * 1e3:.1f}"]
            for bm, bn, bk, warps, stages in SMALL:
                args = (x, qweight, scales, zeros, 128, (bm, bn, bk), warps, stages)
                us = do_bench(lambda a=args: int4.int4_gemm(*a), warmup=25, rep=100) * 1e3
                cells.append(f"{bn}x{bk} w{warps} s{stages} {us:.1f}")
            print(f"{name} {n}x{k} M={m}: " + "; ".join(cells), flush=True)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; us per call (int4.linear / bf16 cuBLAS), int4 weight GB/s at M = 1")
    for name, (n, k) in SHAPES.items():
        qweight, scales, zeros = layer(n, k)
        dense = int4.dequantize(qweight, scales, zeros, 128, torch.bfloat16)
        for m in (1, 4, 16, 128, 1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            got = int4.linear(x, qweight, scales, zeros, 128)
            ref = F.linear(x.float(), dense.float())
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, (name, m, err)
            args = (x, qweight, scales, zeros, 128)
            t4 = do_bench(lambda a=args: int4.linear(*a), warmup=25, rep=100) * 1e3
            t16 = do_bench(lambda a=(x, dense): F.linear(*a), warmup=25, rep=100) * 1e3
            extra = ""
            if m == 1:
                nbytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
                extra = f"  {nbytes / t4 / 1e3:.0f} GB/s"
            if m >= 128:  # the two ways of more rows: the int4 GEMM, and W written out for cuBLAS (DEQUANT_ROWS)
                gemm = do_bench(lambda a=args: int4.int4_gemm(*a), warmup=25, rep=100) * 1e3
                dq = do_bench(lambda a=args: int4.dequantize_weight(*a, torch.bfloat16), warmup=25, rep=100) * 1e3
                extra = f"  (GEMM {gemm:.1f}, dequant {dq:.1f} + cuBLAS)"
            print(f"{name} {n}x{k} M={m}: {t4:.1f} / {t16:.1f}{extra}  (max rel err {err:.1e})", flush=True)


if __name__ == "__main__":
    {"gemv": gemv_tiles, "small": small_m}.get(sys.argv[1] if sys.argv[1:] else "", main)()
