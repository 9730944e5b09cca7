"""`streamer bench gemv`: the decode GEMV on the GPU machine, cuBLAS (F.linear) against
kernels.gemv at M = 1, 2, 4 (bf16).

    streamer bench gemv              # every shape, heuristic + a small sweep (< 3 min)
    streamer bench gemv --no-sweep   # heuristic only
    streamer bench gemv --full       # a wider sweep, to retune gemv_config (longer)
    streamer bench gemv --only fp8   # float8 W and x at M = 1 (quantization "fp8")

Timing is what a decode step sees: a CUDA graph of back-to-back calls (at
least 20), replayed; us per call = replay time / calls. Weights that L2
(50 MB) could keep between calls are rotated over distinct copies, at least
200 MB in all, so every call streams W from HBM as in a real forward pass.
TB/s counts W + x + y bytes once; spd = cuBLAS time / gemv time (glu:
the unfused Triton pair gemv + silu_and_mul over gemv_glu). err: max |gemv - F.linear| (outputs are
~N(0, 1)); e32: max error of gemv / of cuBLAS against an fp32 reference, to
show the kernel is as accurate as cuBLAS. For each (shape, M) the sweep varies
one knob of the heuristic's config at a time (tile, unroll, split-K, per-chunk
reduction), then tries the best of each together; `best` is the fastest
config seen: use it to retune kernels.gemv.gemv_config. The sweep stops when
the time budget runs out (the heuristic rows are always measured).
Config names: n<rows> k<block_k> u<unroll> s<split_k> w<warps>, r = acc_1d.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch and the kernels are imported when the benchmark runs, not with the CLI)
    import torch

    from kernels import gemv as G

DEVICE = "cuda"
ROTATE_BYTES = 200e6
MIN_CALLS = 20
MS = (1, 2, 4)
# (name, N, K): Llama-3.1-8B, Qwen3-0.6B, then the attention GEMVs of Qwen3-30B-A3B (issue 30's batch-1 step)
SHAPES = [
    ("o", 4096, 4096),
    ("qkv", 6144, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
    ("q06.qkv", 4096, 1024),
    ("q06.gate_up", 6144, 1024),
    ("q06.o", 1024, 2048),
    ("q06.down", 1024, 3072),
    ("moe.qkv", 5120, 2048),
    ("moe.o", 2048, 4096),
]
TILES = [(4, 4), (8, 8), (8, 4), (2, 2), (16, 8)]  # (block_n, num_warps)
UNROLLS = (2, 4, 8)
SPLITS = (1, 2, 4, 8)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0 = time.perf_counter()
        self.seconds = seconds
        self.cut = False

    def left(self) -> bool:
        ok = time.perf_counter() - self.t0 < self.seconds
        self.cut |= not ok
        return ok


def _weights(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    import torch

    w = (torch.randn(n, k, device=DEVICE, generator=gen) * k**-0.5).to(torch.bfloat16)
    copies = max(1, math.ceil(ROTATE_BYTES / w.numel() / w.element_size()))
    return [w] + [w.clone() for _ in range(copies - 1)]


def time_graph(fn, ws: list[torch.Tensor], x: torch.Tensor) -> float:
    """us per call of fn(x, w) in a CUDA graph of back-to-back calls rotating over ws."""
    import torch

    calls = max(MIN_CALLS, len(ws))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile / warm up outside the capture
        fn(x, ws[0])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(x, ws[i % len(ws)])
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    reps = max(3, min(50, int(8.0 / max(e0.elapsed_time(e1), 1e-3))))  # ~8 ms per sample
    samples = []
    for _ in range(3):
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        samples.append(1e3 * e0.elapsed_time(e1) / (reps * calls))
    del g
    return sorted(samples)[1]


def copy_tbs() -> float:
    import torch

    a = torch.empty(512 * 2**20, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    us = time_graph(lambda x, w: w.copy_(x), [b], a)
    return 2 * a.numel() / us / 1e6


def sweep_candidates(h: G.GemvConfig, k: int, full: bool) -> list[G.GemvConfig]:
    from kernels import gemv as G

    def ok(c: G.GemvConfig) -> bool:
        return k // c.split_k >= c.block_k * c.unroll or c.split_k == 1

    if full:
        out = [
            G.GemvConfig(block_n=bn, num_warps=nw, unroll=u, split_k=s, acc_1d=r)
            for bn, nw in TILES
            for u in UNROLLS
            for s in SPLITS
            for r in (False, True)
        ]
    else:
        out = [h.with_(block_n=bn, num_warps=nw) for bn, nw in TILES]
        out += [h.with_(unroll=u) for u in UNROLLS]
        out += [h.with_(split_k=s) for s in SPLITS]
        out += [h.with_(split_k=s, unroll=2) for s in SPLITS[1:]]  # finer splits for small N * K
        out += [h.with_(acc_1d=not h.acc_1d)]
    seen, uniq = {str(h)}, []
    for c in out:
        if ok(c) and str(c) not in seen:
            seen.add(str(c))
            uniq.append(c)
    return uniq


def run_sweep(fn, ws, x, ref, h: G.GemvConfig, k: int, full: bool, budget: Budget, h_us: float):
    """(best us, best config) over the sweep around h (h's own time included)."""
    results = {str(h): (h_us, h)}

    def trial(c: G.GemvConfig) -> None:
        if str(c) in results or not budget.left():
            return
        try:
            out = fn(x, ws[0], c)
            bad = (out.float() - ref).abs().max().item() > 0.1
            us = time_graph(lambda a, w: fn(a, w, c), ws, x)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects (registers, shared memory)
            print(f"    {c}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})", flush=True)
            return
        results[str(c)] = (float("inf") if bad else us, c)
        if bad:
            print(f"    {c}: WRONG RESULT", flush=True)

    for c in sweep_candidates(h, k, full):
        trial(c)
    if not full:  # the best knob of each kind together
        best = lambda pred: min((v for v in results.values() if pred(v[1])), key=lambda v: v[0])[1]
        tile = best(lambda c: c.unroll == h.unroll and c.split_k == h.split_k and c.acc_1d == h.acc_1d)
        unroll = best(lambda c: (c.block_n, c.split_k, c.acc_1d) == (h.block_n, h.split_k, h.acc_1d)).unroll
        split = best(lambda c: (c.block_n, c.unroll, c.acc_1d) == (h.block_n, h.unroll, h.acc_1d)).split_k
        trial(tile.with_(unroll=unroll, split_k=split))
    us, c = min(results.values(), key=lambda v: v[0])
    return us, c


def _row(cols: list[str]) -> str:
    return " ".join(cols)


def bench_gemv(args, budget: Budget, gen: torch.Generator, best_table: dict) -> None:
    import torch
    import torch.nn.functional as F

    from kernels import gemv as G

    print(
        f"{'shape':12} {'N':>6} {'K':>6} {'M':>1} | {'cuBLAS':>7} {'TB/s':>4} | {'gemv':>6} {'TB/s':>4} "
        f"{'spd':>4} {'config':14} | {'best':>6} {'TB/s':>4} {'config':16} | {'err':>7} {'e32 g/c':>15}"
    )
    for name, n, k in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        ws = _weights(n, k, gen)
        for m in args.rows or MS:
            x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
            nbytes = (n * k + m * k + m * n) * 2
            tb = lambda us, nbytes=nbytes: nbytes / us / 1e6
            ref32 = F.linear(x.float(), ws[0].float())
            ref = F.linear(x, ws[0])
            h = G.gemv_config(m, n, k, G.num_sms(x.device))
            out = G.gemv(x, ws[0])
            err = (out.float() - ref.float()).abs().max().item()
            e32g = (out.float() - ref32).abs().max().item()
            e32c = (ref.float() - ref32).abs().max().item()
            cub = time_graph(lambda a, w: F.linear(a, w), ws, x)
            us = time_graph(lambda a, w: G.gemv(a, w), ws, x)
            best_us, best = us, h
            if args.sweep and budget.left():
                best_us, best = run_sweep(
                    lambda a, w, c: G.gemv(a, w, c), ws, x, ref32, h, k, args.full, budget, us
                )
            best_table[(name, m)] = (best_us, best, us, h)
            print(
                f"{name:12} {n:6d} {k:6d} {m:1d} | {cub:7.1f} {tb(cub):4.2f} | {us:6.1f} {tb(us):4.2f} "
                f"{cub / us:4.2f} {str(h):14} | {best_us:6.1f} {tb(best_us):4.2f} {str(best):16} | "
                f"{err:7.1e} {e32g:7.1e}/{e32c:7.1e}",
                flush=True,
            )
        del ws
        torch.cuda.empty_cache()


GLU_SHAPES = [("gate_up", 28672, 4096), ("q06.gate_up", 6144, 1024)]  # (name, 2I, K): W is [gate; up]
GLU_TILES = [(4, 4), (8, 8), (8, 4), (16, 8), (4, 8), (16, 16)]  # (block_n per half, num_warps)


def bench_glu(args, budget: Budget, gen: torch.Generator) -> None:
    """M = 1: gate_up projection + silu_and_mul, unfused (cuBLAS or gemv, then the activation
    kernel) against gemv_glu (activation in the epilogue), and a sweep of gemv_glu tiles."""
    import torch
    import torch.nn.functional as F

    from kernels import activation
    from kernels import gemv as G

    print(
        f"\n{'gate_up+act':12} {'2I':>6} {'K':>6} | {'cuBLAS+act':>10} | {'gemv+act':>8} | "
        f"{'glu':>6} {'TB/s':>4} {'spd':>4} {'config':14} | {'best':>6} {'config':16} | {'err':>7}"
    )
    for name, n2, k in GLU_SHAPES:
        ws = _weights(n2, k, gen)
        x = torch.randn(1, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        nbytes = (n2 * k + k + n2 // 2) * 2
        ref32 = activation.silu_and_mul(F.linear(x, ws[0])).float()
        err = (G.gemv_glu(x, ws[0]).float() - ref32).abs().max().item()
        h = G.glu_config(n2 // 2, k)
        base = time_graph(lambda a, w: activation.silu_and_mul(F.linear(a, w)), ws, x)
        unfused = time_graph(lambda a, w: activation.silu_and_mul(G.gemv(a, w)), ws, x)
        us = time_graph(lambda a, w: G.gemv_glu(a, w), ws, x)
        results = {str(h): (us, h)}
        if args.sweep:
            cands = [h.with_(block_n=bn, num_warps=nw) for bn, nw in GLU_TILES]
            cands += [h.with_(unroll=u) for u in UNROLLS] + [h.with_(block_k=512, unroll=2)]
            for c in cands:
                if str(c) in results or not budget.left():
                    continue
                try:
                    bad = (G.gemv_glu(x, ws[0], c).float() - ref32).abs().max().item() > 0.1
                    results[str(c)] = (
                        float("inf") if bad else time_graph(lambda a, w, c=c: G.gemv_glu(a, w, c), ws, x),
                        c,
                    )
                except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                    print(f"    {c}: failed ({type(e).__name__})", flush=True)
        best_us, best = min(results.values(), key=lambda v: v[0])
        print(
            f"{name:12} {n2:6d} {k:6d} | {base:10.1f} | {unfused:8.1f} | {us:6.1f} "
            f"{nbytes / us / 1e6:4.2f} {unfused / us:4.2f} {str(h):14} | {best_us:6.1f} {str(best):16} | "
            f"{err:7.1e}",
            flush=True,
        )
        del ws
        torch.cuda.empty_cache()


def _fp8_shape(args, budget: Budget, gen: torch.Generator, name: str, n: int, k: int) -> None:
    import torch

    from kernels import activation, ops
    from kernels import gemv as G

    bf = torch.bfloat16
    ws = _weights(n, k, gen)
    qs = [ops.quantize_rows_fp8(w) for w in ws]
    qs = [(q, s.view(-1)) for q, s in qs]
    x = torch.randn(1, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    qx, sx = ops.quantize_rows_fp8(x)
    glu = name == "glu"
    nbytes = n * k + k + (n // 2 if glu else n) * 2
    if glu:
        fp8 = lambda a, w, c=None: G.gemv_glu(qx, w[0], c, scales=(sx, w[1]), out_dtype=bf)
        ref = activation.silu_and_mul(torch._scaled_mm(qx, qs[0][0].t(), sx, qs[0][1].view(1, -1), out_dtype=bf))
        h = G.glu_config(n // 2, k, 1)
        bf16 = time_graph(lambda a, w: G.gemv_glu(a, w), ws, x)
        cub = time_graph(
            lambda a, w: activation.silu_and_mul(torch._scaled_mm(qx, w[0].t(), sx, w[1].view(1, -1), out_dtype=bf)),
            qs, x,
        )
    else:
        fp8 = lambda a, w, c=None: G.gemv(qx, w[0], c, scales=(sx, w[1]), out_dtype=bf)
        ref = torch._scaled_mm(qx, qs[0][0].t(), sx, qs[0][1].view(1, -1), out_dtype=bf)
        h = G.gemv_config(1, n, k, G.num_sms(x.device), 1)
        bf16 = time_graph(lambda a, w: G.gemv(a, w), ws, x)
        cub = time_graph(lambda a, w: torch._scaled_mm(qx, w[0].t(), sx, w[1].view(1, -1), out_dtype=bf), qs, x)
    err = (fp8(x, qs[0]).float() - ref.float()).abs().max().item()
    us = time_graph(fp8, qs, x)
    results = {str(h): (us, h)}
    if args.sweep:
        cands = [h.with_(block_k=bk, unroll=u) for bk in (256, 512, 1024) for u in (2, 4, 8)]
        cands += [h.with_(block_n=bn, num_warps=nw) for bn, nw in TILES]
        for c in cands:
            if str(c) in results or not budget.left() or (k % (c.block_k * c.unroll) and glu):
                continue
            try:
                bad = (fp8(x, qs[0], c).float() - ref.float()).abs().max().item() > 0.1
                results[str(c)] = (float("inf") if bad else time_graph(lambda a, w, c=c: fp8(a, w, c), qs, x), c)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                print(f"    {c}: failed ({type(e).__name__})", flush=True)
    best_us, best = min(results.values(), key=lambda v: v[0])
    print(
        f"{name:12} {n:6d} {k:6d} | {bf16:9.1f} | {cub:9.1f} | {us:8.1f} {nbytes / us / 1e6:4.2f} {str(h):14} | "
        f"{best_us:6.1f} {nbytes / best_us / 1e6:4.2f} {str(best):16} | {err:7.1e}",
        flush=True,
    )
    del ws, qs
    torch.cuda.empty_cache()


def bench_fp8(args, budget: Budget, gen: torch.Generator) -> None:
    """M = 1 with float8 operands (quantization "fp8"): the bf16 GEMV of the unquantized W,
    cuBLAS's float8 GEMM (torch._scaled_mm) and the float8 GEMV on the same quantized x and W,
    then a sweep of the float8 GEMV's chunk, unroll and tile; glu: gate_up + activation."""
    import torch

    from kernels import ops

    print(
        f"\n{'float8, M=1':12} {'N':>6} {'K':>6} | {'bf16 gemv':>9} | {'scaled_mm':>9} | {'fp8 gemv':>8} {'TB/s':>4} "
        f"{'config':14} | {'best':>6} {'TB/s':>4} {'config':16} | {'err':>7}"
    )
    for name, n, k in [*SHAPES[:4], ("glu", 28672, 4096)]:
        _fp8_shape(args, budget, gen, name, n, k)
    q_us = time_graph(lambda a, w: ops.quantize_rows_fp8(a), [None], torch.randn(1, 4096, device=DEVICE).to(torch.bfloat16))
    print(f"quantize one row of 4096: {q_us:.1f} us")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="heuristic configs only")
    p.add_argument("--full", action="store_true", help="sweep every tile x unroll x split x acc_1d")
    p.add_argument("--only", choices=("gemv", "glu", "fp8"), help="one table only")
    p.add_argument("--budget", type=float, default=None, help="seconds after which sweeping stops")
    p.add_argument("--shapes", type=lambda v: v.split(","), default=None,
                   help="comma-separated shape names of the gemv table (default: all)")
    p.add_argument("--rows", type=lambda v: [int(m) for m in v.split(",")], default=None,
                   help="comma-separated M of the gemv table (default: 1,2,4)")


def main(args: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench gemv: needs a CUDA GPU")
    budget = Budget(args.budget if args.budget is not None else (1e9 if args.full else 120.0))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton

    print(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}; "
        f"graph copy {copy_tbs():.2f} TB/s; times in us per call"
    )
    best_table: dict = {}
    if args.only in (None, "gemv"):
        bench_gemv(args, budget, gen, best_table)
    if args.only in (None, "glu"):
        bench_glu(args, budget, gen)
    if args.only in (None, "fp8"):
        bench_fp8(args, budget, gen)
    changed = [(k, v) for k, v in best_table.items() if str(v[1]) != str(v[3]) and v[0] < 0.97 * v[2]]
    if changed:
        print("\nconfigs >3% faster than the heuristic's (shape, M: best [heuristic]):")
        for (name, m), (b_us, b, h_us, h) in changed:
            print(f"  {name:12} M{m}: {b} {b_us:.1f} us  [{h} {h_us:.1f} us]")
    if budget.cut:
        print(f"(sweep cut short after {budget.seconds:.0f} s: later rows show the heuristic only)")
    print(f"total {time.perf_counter() - budget.t0:.0f} s")
