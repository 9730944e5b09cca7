"""The float8 GEMM for a few dozen rows (kernels/fp8_gemm.py) against cuBLAS's row-wise float8 GEMM
(torch._scaled_mm), by row count, on the float8 layers of the Qwen3-30B-A3B and Llama-3.1-8B shapes,
each call replayed from a CUDA graph (as in a decode step); the default tiles and neighbours, and the
weight's bytes over the card's time.

    python3 benchmarks/fp8_gemm_bench.py [--rows 8,32,64,133,256]
"""

# ruff: noqa: B023  (each lambda is timed before the loop moves on)
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from kernels import fp8_gemm, reference  # noqa: E402
from kernels.common import sm_count  # noqa: E402

LAYERS = {  # (N, K) of the float8 linear layers
    "qwen3-30b-a3b qkv": (5120, 2048),
    "qwen3-30b-a3b o": (2048, 4096),
    "llama-3.1-8b qkv": (6144, 4096),
    "llama-3.1-8b o": (4096, 4096),
    "llama-3.1-8b down": (4096, 14336),
    "llama-3.1-8b gate_up": (28672, 4096),
}

TILES = ((16, 32, 128, 4, 4), (32, 32, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 64, 128, 8, 3),
         (64, 32, 256, 4, 3), (128, 64, 128, 8, 3))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="8,32,64,133,256")
    a = p.parse_args()
    dev = torch.device("cuda")
    for name, (n, k) in LAYERS.items():
        qw, sw = reference.quantize_rows_fp8(torch.randn(n, k, device=dev) * k**-0.5)
        sw = sw.view(-1)
        for m in (int(r) for r in a.rows.split(",")):
            q, sx = reference.quantize_rows_fp8(torch.randn(m, k, device=dev))
            cublas = 1e3 * do_bench_cudagraph(lambda: torch._scaled_mm(q, qw.t(), scale_a=sx, scale_b=sw.view(1, -1),
                                                                         out_dtype=torch.bfloat16))
            default = fp8_gemm.tiles(m, n, sm_count(dev))
            cells = []
            for bm, bn, bk, warps, stages in TILES:
                if bm > max(16, 2 * m) and (bm, bn, bk) != default:  # (the default always timed)
                    continue
                us = 1e3 * do_bench_cudagraph(lambda: fp8_gemm.fp8_gemm(q, sx, qw, sw, torch.bfloat16, (bm, bn, bk),
                                                                       warps, stages))
                mark = "*" if (bm, bn, bk) == default and (warps, stages) == (4, fp8_gemm.STAGES[bk]) else ""
                cells.append(f"{bm}x{bn}x{bk} w{warps} s{stages}{mark} {us:.1f}")
            use = "triton" if fp8_gemm.use_triton(m, n, dev) else "cublas"
            print(f"{name} M {m}: cuBLAS {cublas:.1f} us ({n * k / cublas / 1e6:.2f} TB/s), uses {use}; "
                  + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
