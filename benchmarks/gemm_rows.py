"""What a few rows past a multiple of the GEMM's tile cost: F.linear (cuBLAS) of the Llama-3.1-8B
layer's four projections at M rows, for M around a prefill of 512 tokens.

W5's step trace (benchmarks/RESULTS.md, thirty-ninth session) shows a 512-token prefill step at
11.9 ms alone and 14.1 ms with 1-5 decode rows beside it: this times the layer's GEMMs at each M
to see whether the rows past 512 are what costs the 2.2 ms.

    python3 benchmarks/gemm_rows.py [--rows 512 513 ...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def time_us(fn, reps: int = 50) -> float:
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[384, 448, 500, 512, 513, 516, 520, 528, 544, 576, 640])
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    ws = {k: torch.randn(n, kk, dtype=torch.bfloat16, device="cuda") * 0.02 for k, (n, kk) in SHAPES.items()}
    print(f"{'M':>5} " + " ".join(f"{k:>9}" for k in SHAPES) + "  layer us  TFLOP/s")
    for m in args.rows:
        ts = []
        flops = 0
        for k, (n, kk) in SHAPES.items():
            x = torch.randn(m, kk, dtype=torch.bfloat16, device="cuda")
            w = ws[k]
            ts.append(time_us(lambda x=x, w=w: F.linear(x, w)))
            flops += 2 * m * n * kk
        total = sum(ts)
        print(f"{m:5d} " + " ".join(f"{t:9.1f}" for t in ts) + f"  {total:8.1f}  {flops / total / 1e6:7.0f}")


if __name__ == "__main__":
    main()
