"""Can a batch-1 GEMV read its weight from L2, prefetched while a latency-bound kernel runs?

At batch 1 a decode layer alternates bandwidth-bound GEMVs with latency-bound kernels (rotary,
attention and its merge, the router) during which the memory bus idles (benchmarks/RESULTS.md,
thirty-third session: ~16 us a layer of the MoE shape's 61 us). A kernel on a side stream could
ask L2 for the next GEMV's weight meanwhile. This probe measures, in CUDA graphs on one GPU:

  cold      flush L2, a spin of S us (the latency-bound kernels), the GEMV
  warm      the same with the GEMV run once before the spin (its weight in L2: the upper bound)
  prefetch  cold, with a side-stream kernel asking L2 for the weight as the spin starts
            (prefetch.global.L2::evict_last, one line per thread)

and prints the GEMV's time in each (the graph's time less that of flush + spin alone).

    python3 benchmarks/l2_probe.py [--spin-us 4 8] [--reps 50]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from kernels.gemv import gemv

SHAPES = {"o 2048x4096": (2048, 4096), "qkv 5120x2048": (5120, 2048), "8B o 4096x4096": (4096, 4096),
          "8B qkv 6144x4096": (6144, 4096)}


@triton.jit
def _prefetch_kernel(ptr, n_lines, LINES_PER_PROG: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Ask L2 for LINES_PER_PROG 128-byte lines from this program's start (a hint: no register
    holds the data, nothing waits)."""
    first = tl.program_id(0).to(tl.int64) * LINES_PER_PROG
    offs = first + tl.arange(0, LINES_PER_PROG)
    ptrs = ptr + tl.minimum(offs, n_lines - 1) * 128
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, lines_per_prog: int = 1024, evict_last: bool = True) -> None:
    n_lines = triton.cdiv(w.numel() * w.element_size(), 128)
    u8 = w.view(torch.uint8).view(-1)
    _prefetch_kernel[(triton.cdiv(n_lines, lines_per_prog),)](u8, n_lines, LINES_PER_PROG=lines_per_prog,
                                                               EVICT_LAST=evict_last, num_warps=4)


def graph_us(body, reps: int) -> float:
    """Microseconds per rep of body(i) for i in range(reps), captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            body(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            body(i)
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
    p.add_argument("--spin-us", type=float, nargs="+", default=[4.0, 8.0])
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}, L2 {props.L2_cache_size / 2**20:.0f} MiB")
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    # cycles per us: time a long spin
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    cycles_per_us = 10_000_000 / (a.elapsed_time(b) * 1e3)

    def flush() -> None:
        flush_buf.add_(1)

    for name, (n, k) in SHAPES.items():
        # copies used in turn: an evict_last line of one rep's prefetch must not still be in L2 at
        # the next use of its copy (7 copies' prefetches come between)
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(8)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        mb = n * k * 2 / 1e6
        for spin in args.spin_us:
            t = measure(ws, x, int(spin * cycles_per_us), args.reps, flush, side)
            print(f"{name:18} {mb:6.1f} MB spin {spin:4.1f} us: gemv cold {t['cold']:6.2f} us "
                  f"({mb / t['cold']:5.2f} TB/s)  warm {t['warm']:6.2f}  prefetch evict_last {t['pf_last']:6.2f}  "
                  f"prefetch normal {t['pf_normal']:6.2f}")


def measure(ws, x, cyc: int, reps: int, flush, side) -> dict[str, float]:
    """The GEMV's microseconds cold, warm and with each prefetch (graph times less the rest's)."""

    def base(i: int) -> None:
        flush()
        torch.cuda._sleep(cyc)

    def cold(i: int) -> None:
        base(i)
        gemv(x, ws[i % 8])

    def one(i: int) -> None:
        flush()
        gemv(x, ws[i % 8])

    def warm(i: int) -> None:
        one(i)
        torch.cuda._sleep(cyc)
        gemv(x, ws[i % 8])

    def with_prefetch(evict_last: bool):
        def body(i: int) -> None:
            flush()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(ws[i % 8], evict_last=evict_last)
            torch.cuda._sleep(cyc)
            gemv(x, ws[i % 8])
            torch.cuda.current_stream().wait_stream(side)
        return body

    t_base = graph_us(base, reps)
    t_one = graph_us(one, reps) - graph_us(lambda i: flush(), reps)
    return {
        "cold": graph_us(cold, reps) - t_base,
        "warm": graph_us(warm, reps) - t_base - t_one,
        "pf_last": graph_us(with_prefetch(True), reps) - t_base,
        "pf_normal": graph_us(with_prefetch(False), reps) - t_base,
    }


if __name__ == "__main__":
    main()
