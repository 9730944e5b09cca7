"""One mixture-of-experts layer on the GPU, by token count: the grouped GEMM (kernels/moe.py)
against the few-token GEMV (kernels/moe_gemv.py), and the router's top-k, each replayed from
a CUDA graph (launch gaps as in a decode step), with the bytes each call must read.

    python3 benchmarks/moe_layer.py [--hidden 2048 --inter 768 --experts 128 --top-k 8]
    python3 benchmarks/moe_layer.py --sweep     # the grouped GEMM's tiles by token count (default_config)
    python3 benchmarks/moe_layer.py --sweep --fp8   # the same with float8 experts (per-row scales, as
                                                    # --quantization fp8 makes them) and float8 tiles too
    python3 benchmarks/moe_layer.py --int4 [--sweep]  # int4 experts (kernels/moe_int4.py, group 128): the
                                                      # GEMVs' tiles by token count, or the grouped GEMMs' sweep
"""

# ruff: noqa: B023  (each lambda is timed before the loop moves on)
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

from kernels import moe, moe_gemv, moe_int4, moe_route, moe_tiles, reference, reference_moe

BANDWIDTH = 4.25e12


def graphed(fn, reps: int = 20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g, reps


def time_us(fn, iters: int = 20) -> float:
    g, reps = graphed(fn)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (iters * reps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,2,4,8,16,32")
    p.add_argument("--sweep", action="store_true", help="time fused_moe's tile configs at decode and prefill sizes")
    p.add_argument("--fp8", action="store_true", help="--sweep with float8 experts (per-row scales)")
    p.add_argument("--int4", action="store_true", help="int4 experts (group 128): GEMV tiles, or --sweep's")
    p.add_argument("--write", type=Path, help="--sweep: merge the fastest tiles per bucket of rows per expert "
                   "into this table (kernels/moe_tiles.py; e.g. kernels/moe_tiles/<card>.json)")
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, i, e, k = a.hidden, a.inter, a.experts, a.top_k
    w_gu = (torch.randn(e, 2 * i, h, device=dev) * h**-0.5).to(dt)
    w_d = (torch.randn(e, h, i, device=dev) * i**-0.5).to(dt)
    router = (torch.randn(e, h, device=dev) * h**-0.5).to(dt)
    per_expert = 3 * h * i * 2
    print(f"H {h} I {i} E {e} k {k}: {per_expert / 1e6:.2f} MB per expert")
    if a.int4:
        int4_layer(w_gu, w_d, router, k, a)
        return
    if a.sweep:
        scales = None
        if a.fp8:  # (per expert and row, as quantization "fp8" stores them: model/moe.py Experts.quantize_fp8)
            w_gu, s_gu = _quantize_experts(w_gu)
            w_d, s_d = _quantize_experts(w_d)
            scales = (s_gu, s_d)
        best = sweep(w_gu, w_d, router, k, scales)
        if a.write:
            name = torch.cuda.get_device_name(dev)
            moe_tiles.write(a.write, name, "fp8" if a.fp8 else "bf16", best)
            print(f"wrote {a.write} ({name}): {best}")
        return
    print(f"{'T':>4} {'experts hit':>11} {'floor us':>9} {'grouped us':>10} {'gemv us':>8} {'route us':>9} {'torch route us':>14}")
    for t in [int(x) for x in a.tokens.split(",")]:
        x = torch.randn(t, h, device=dev).to(dt)
        logits = torch.nn.functional.linear(x, router)
        weights, ids = reference_moe.route_topk(logits, k, True, dt)
        hit = torch.unique(ids).numel()
        floor = 1e6 * hit * per_expert / BANDWIDTH
        grouped = time_us(lambda: moe.fused_moe(x, w_gu, w_d, weights, ids))
        gemv = time_us(lambda: moe_gemv.moe_gemv(x, w_gu, w_d, weights, ids))
        route = time_us(lambda: moe_route.route_topk(logits, k, True, dt))
        torch_route = time_us(lambda: reference_moe.route_topk(logits, k, True, dt))
        print(f"{t:4d} {hit:11d} {floor:9.1f} {grouped:10.1f} {gemv:8.1f} {route:9.1f} {torch_route:14.1f}")
        if moe_gemv.use_gemv(t):
            for warps in (1, 2, 4):
                us = time_us(lambda: moe_route.route(x, router, k, True, dt, num_warps=warps))
                print(f"      fused router, {warps} warps: {us:7.1f} us")
        for bn, bk, un in ((4, 256, 1), (4, 256, 2), (8, 256, 2), (4, 512, 1), (2, 256, 2), (2, 256, 4), (2, 512, 2),
                           (1, 512, 4), (4, 256, 4), (1, 256, 8)):
            us = time_us(lambda: moe_gemv.moe_gemv(x, w_gu, w_d, weights, ids, block_n=bn, block_k=bk, unroll=un))
            print(f"      gemv gate_up n {bn:3d} k {bk:4d} unroll {un}: {us:7.1f} us ({floor / us:5.1%} of floor)")
        for down in ((4, 256, 1, 8), (4, 256, 3, 8), (2, 256, 1, 4), (4, 256, 1, 4), (8, 256, 1, 8), (2, 256, 3, 8),
                     (4, 128, 2, 8), (1, 256, 3, 4), (4, 128, 6, 8), (2, 128, 6, 4), (2, 128, 3, 4), (1, 128, 6, 2),
                     (2, 256, 3, 4), (4, 128, 3, 8)):
            try:
                us = time_us(lambda: moe_gemv.moe_gemv(x, w_gu, w_d, weights, ids, down=down))
            except Exception as ex:  # noqa: BLE001 - e.g. out of registers
                print(f"      gemv down {down}: {type(ex).__name__}")
                continue
            print(f"      gemv down (n, k, unroll, warps) {down}: {us:7.1f} us ({floor / us:5.1%} of floor)")


SWEEP = {  # (block_m, block_n, block_k, num_warps, num_stages)
    (64, 128, 256): [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (16, 64, 128, 4, 3), (16, 128, 128, 4, 3),
                     (16, 64, 256, 4, 3), (16, 256, 64, 8, 3), (16, 32, 128, 4, 4), (16, 64, 128, 4, 5)],
    (512, 1024): [(32, 64, 64, 4, 3), (32, 128, 64, 4, 3), (32, 64, 128, 4, 3), (32, 128, 128, 8, 3),
                  (64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (16, 64, 128, 4, 3)],
    (4096, 16384): [(64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3),
                    (128, 64, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 32, 8, 4), (128, 256, 64, 8, 3)],
}


SWEEP_FP8 = {  # float8 experts: deeper K chunks too (a float8 chunk of 128 moves half a bf16 one's bytes)
    (64, 128, 256): [(16, 64, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (16, 128, 256, 4, 3),
                     (16, 64, 128, 4, 4), (16, 64, 256, 4, 4), (16, 64, 256, 4, 5), (16, 32, 256, 4, 4),
                     (16, 128, 256, 8, 3), (16, 64, 512, 4, 3), (32, 64, 128, 4, 3), (32, 64, 256, 4, 3),
                     (32, 128, 128, 4, 3), (16, 256, 128, 8, 3)],
    (512, 1024): [(32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (64, 128, 128, 4, 3),
                  (64, 128, 128, 8, 3), (32, 128, 128, 4, 4), (64, 64, 256, 4, 3), (32, 64, 256, 4, 3)],
    (4096,): [(64, 256, 64, 8, 3), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (64, 256, 128, 8, 3),
              (128, 256, 128, 8, 3), (64, 128, 128, 4, 4)],
}


SWEEP_INT4 = {  # int4 experts: the tiles' registers matter most (each K tile dequantized in them; ptxas spills
    # the wider ones: benchmarks/RESULTS.md, thirty-second session)
    (64, 128, 256): [(16, 64, 128, 4, 3), (16, 64, 64, 4, 3), (16, 128, 64, 4, 2), (16, 32, 128, 4, 3),
                     (16, 64, 128, 4, 2), (16, 128, 128, 8, 3), (16, 64, 64, 4, 4), (32, 64, 64, 4, 3)],
    (512, 1024): [(32, 64, 64, 4, 3), (64, 64, 64, 4, 3), (64, 64, 64, 8, 3), (64, 128, 64, 8, 3),
                  (32, 128, 64, 4, 3), (16, 64, 128, 4, 3), (64, 64, 128, 8, 3)],
    (4096,): [(64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 64, 8, 3),
              (64, 64, 64, 4, 3), (128, 128, 32, 8, 4)],
}


def int4_experts(shape: tuple[int, int, int], group: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random int4 experts [E, N, K] in kernels/moe_int4.py's layout (qweight, scales, zeros)."""
    e, n, k = shape
    q = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(e, n, k // group, device="cuda") * 0.02 / k**0.5).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (e, n, k // group), dtype=torch.uint8, device="cuda")
    return q, scales, zeros


def int4_layer(w_gu: torch.Tensor, w_d: torch.Tensor, router: torch.Tensor, k: int, a: argparse.Namespace) -> None:
    """int4 experts of the layer's shape: with --sweep the grouped GEMMs' tiles (--write: the "int4"
    entries of the table); else, by token count, the grouped GEMMs (default tiles) against the GEMVs
    (each (BLOCK_N, num_warps)) and the bf16 layer (fused_moe's own choice of path)."""
    e, two_i, h = w_gu.shape
    i = two_i // 2
    gu, d = int4_experts((e, two_i, h)), int4_experts((e, h, i))
    if a.sweep:
        best = sweep(w_gu, w_d, router, k, int4=(gu, d))
        if a.write:
            name = torch.cuda.get_device_name()
            moe_tiles.write(a.write, name, "int4", best)
            print(f"wrote {a.write} ({name}): {best}")
        return
    per_expert = 3 * h * i / 2 + 3 * (h * i // 128) * 3  # (packed words, bf16 scales and uint8 zeros)
    print(f"{'T':>4} {'experts hit':>11} {'floor us':>9} {'bf16 us':>8} {'grouped us':>10} GEMV (BLOCK_N, warps): us")
    for t in [int(x) for x in a.tokens.split(",")]:
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        weights, ids = reference_moe.route_topk(torch.nn.functional.linear(x, router), k, True, x.dtype)
        hit = torch.unique(ids).numel()
        floor = 1e6 * hit * per_expert / BANDWIDTH
        bf16 = time_us(lambda: (moe_gemv.moe_gemv if moe_gemv.use_gemv(t) else moe.fused_moe)(x, w_gu, w_d, weights,
                                                                                                 ids))
        cfg = moe.default_config(t * k, e, h, i, "int4", x.device)
        grouped = time_us(lambda: moe_int4.fused_moe_int4(x, gu, d, (128, 128), weights, ids, config=cfg))
        gemv = []
        for tile in ((8, 4), (16, 4), (16, 8), (32, 4), (32, 8), (64, 8)):
            us = time_us(lambda: moe_int4.fused_moe_int4(x, gu, d, (128, 128), weights, ids, gemv=tile))
            mark = "*" if tile == moe_int4.GEMV else ""
            gemv.append(f"{tile}{mark} {us:.1f}")
        print(f"{t:4d} {hit:11d} {floor:9.1f} {bf16:8.1f} {grouped:10.1f} {'; '.join(gemv)}", flush=True)


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> float8 [E, N, K] and fp32 scales [E, N], one per row of each expert."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], row = reference.quantize_rows_fp8(w[e])
        s[e] = row.view(-1)
    return q, s


def sweep(w_gu: torch.Tensor, w_d: torch.Tensor, router: torch.Tensor, k: int,
          scales: tuple[torch.Tensor, torch.Tensor] | None = None, int4: tuple | None = None
          ) -> dict[int | None, tuple[int, ...]]:
    """fused_moe (align, both GEMMs, combine) per tile config: us per call, the weights' bytes
    rate (experts hit) and the GEMMs' TFLOP/s; '*' marks default_config's choice. scales: the
    experts' float8 per-row scales (w_gu and w_d float8), with the float8 tile list.
    Returns the fastest tiles per bucket of mean rows per expert (moe_tiles.BUCKETS): the least
    mean of each token count's time over its best time, among tiles timed at all the bucket's
    token counts. int4: (gate_up, down) int4 experts (kernels/moe_int4.py, group 128) timed instead,
    with the int4 tile list."""
    e, two_i, h = w_gu.shape
    i = two_i // 2
    size = 0.5 if int4 is not None else w_gu.element_size()
    kind = "int4" if int4 is not None else "bf16" if scales is None else "fp8"
    fp8 = {} if scales is None else {"w_gate_up_scale": scales[0], "w_down_scale": scales[1]}
    dtype = torch.bfloat16 if scales is not None else w_gu.dtype
    rel: dict[int | None, dict[tuple[int, ...], list[float]]] = defaultdict(lambda: defaultdict(list))
    counts: dict[int | None, int] = defaultdict(int)
    for sizes, configs in {"bf16": SWEEP, "fp8": SWEEP_FP8, "int4": SWEEP_INT4}[kind].items():
        for t in sizes:
            times: dict[tuple[int, ...], float] = {}
            x = torch.randn(t, h, device=w_gu.device).to(dtype)
            weights, ids = reference_moe.route_topk(torch.nn.functional.linear(x, router), k, True, x.dtype)
            hit = torch.unique(ids).numel()
            flops = 2 * t * k * 3 * h * i
            chosen = moe.default_config(t * k, e, h, i, kind)
            print(f"T {t}: {hit} experts hit, {hit * 3 * h * i * size / 1e6:.0f} MB, {flops / 1e9:.1f} GFLOP; "
                  f"default {chosen}")
            for tiles in [*configs, None]:  # (None: the default, also where the list lacks it)
                if tiles is None:
                    if chosen in [moe.MoeConfig(block_m=c[0], block_n=c[1], block_k=c[2], num_warps=c[3],
                                                num_stages=c[4]) for c in configs]:
                        continue
                    tiles = (chosen.block_m, chosen.block_n, chosen.block_k, chosen.num_warps, chosen.num_stages)
                bm, bn, bk, nw, ns = tiles
                cfg = moe.MoeConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                try:
                    if int4 is not None:
                        us = time_us(lambda: moe_int4.fused_moe_int4(x, *int4, (128, 128), weights, ids, config=cfg),
                                     iters=5)
                    else:
                        us = time_us(lambda: moe.fused_moe(x, w_gu, w_d, weights, ids, config=cfg, **fp8), iters=5)
                except Exception as ex:  # noqa: BLE001 - e.g. out of shared memory
                    print(f"   {bm:4d} {bn:4d} {bk:4d} w{nw} s{ns}: {type(ex).__name__}")
                    continue
                times[tiles] = us
                mark = "*" if cfg == chosen else " "
                print(f" {mark} {bm:4d} {bn:4d} {bk:4d} w{nw} s{ns}: {us:9.1f} us  {hit * 3 * h * i * size / us / 1e6:6.2f} TB/s"
                      f"  {flops / us / 1e6:6.1f} TFLOP/s")
            b = moe_tiles.bucket(t * k / e)
            counts[b] += 1
            for tiles, us in times.items():
                rel[b][tiles].append(us / min(times.values()))
    return {b: min((c for c in rel[b] if len(rel[b][c]) == counts[b]), key=lambda c: sum(rel[b][c]))
            for b in rel}


if __name__ == "__main__":
    main()
