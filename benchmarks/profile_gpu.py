"""Where the time goes, on the GPU machine (diagnostics, not a benchmark of record).

    python3 benchmarks/profile_gpu.py PART [options]

Linear layers:
  gemm          F.linear at decode shapes of Llama-3.1-8B: TB/s
  gemm-fp8      bf16 against float8 linear layers at W3's row counts
  gemm-rows     linear layers by row count: where padding is free (--rows 487,512,...)
  gemm-layouts  the decode step's linear layers by weight layout and cuBLAS path
Attention and small kernels:
  attn          paged decode attention variants (time per call incl. host)
  attn-b1       batch-1 decode attention by launch config, in CUDA graphs (W2's regime)
  attn-kv       decode attention over bf16 vs float8 pages, large batches
  attn-fp8      float8 pages: launch-config sweep, occupancy, asm (--out DIR)
  attn-occ      float8 pages, one warp per program: block size and register caps
  attn-subtile  per-token against sub-tiled addressing, by V layout (decode and extend)
  attn-w3       decode and extend at the shapes of a W3 run's kernel profile
  attn-one      the default float8 decode kernel at one W3 shape (a target for ncu)
  attn-order    decode attention by batch order (longest first?)
  small-ops     silu_and_mul and fused add + RMSNorm by launch config
  overlap       attention beside the GEMMs: micro-batches on two streams
  power         board power, SM clock and energy per call of kernels run back to back
Engine steps and the host:
  step          kernel-time breakdown of decode steps, and the gaps before each kernel (--case N, --graphs,
                --kv-cache-dtype, --quantization, --out DIR: the chrome trace)
  mixed         a 512-token prefill step alone, then with one more row beside it (W5 at 2 req/s), by kernel
  grammar       device work of JSON-constrained steps (--model DIR)
  ttft          a lone request: wall vs GPU time to first token (--set key=value ...; --launch:
                the runner's step called directly, with a cProfile)
  w1cpu         host profile (stack sampling) of a W1 run (-n requests)
  serve         host profile of the server under `streamer bench serve` at saturation (-n prompts)

The host profiles sample every thread's Python stack each millisecond
(streamer.bench.stacks.StackSampler) and print the functions with the most samples, self
and inclusive, per thread: what the scheduler, executor and detokenizer actors spend their
time on while the GPU runs.
"""

# ruff: noqa: B023 - the lambdas are timed on the spot, inside their loop iteration
from __future__ import annotations

import argparse
import collections
import itertools
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "benchmarks" / "configs"


def _time_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return 1e3 * e0.elapsed_time(e1) / reps


def _time_graph_us(fns, reps: int = 20) -> float:
    """Device time per call of short kernels: the calls `fns` (one per input buffer, so that
    L2 does not serve a call the bytes of the one before) captured `reps` times in a CUDA
    graph, so that host launches do not count."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for fn in fns:
                fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    return 1e3 * e0.elapsed_time(e1) / (reps * len(fns))


def bench_attn() -> None:
    """Decode attention variants (Llama-3.1-8B heads: 32 q, 8 kv, d 128, page 16)."""
    from kernels import attention

    cases = [(1, 400), (1, 2000), (8, 1000), (64, 2048), (128, 1500), (256, 1024)]
    for b, ctx in cases:
        pages = (ctx + 15) // 16
        kc = torch.randn(b * pages + 1, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        pt = torch.arange(1, b * pages + 1, device="cuda", dtype=torch.int32).view(b, pages)
        sl = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
        gb = 2 * b * ctx * 8 * 128 * 2 / 1e12
        base = _time_us(lambda: attention.paged_decode(q, kc, vc, pt, sl, 0.088, max_seq_len=2048))
        rows = []
        for splits in (1, 2, 4, 8, 16, 32):
            for bn in (32, 64):
                for nw in (2, 4):
                    for ns in (1, 2, 3):
                        try:
                            t = _time_us(lambda: attention.paged_decode(
                                q, kc, vc, pt, sl, 0.088, num_splits=splits, block_n=bn, num_warps=nw,
                                num_stages=ns), reps=20)
                        except Exception:  # noqa: BLE001
                            continue
                        rows.append((t, splits, bn, nw, ns))
        rows.sort()
        print(f"attn B={b:3d} ctx={ctx:4d}: default {base:7.1f} us ({gb / base * 1e6:4.2f} TB/s); best "
              + ", ".join(f"{t:.1f}us s{s} n{bn} w{nw} st{ns}" for t, s, bn, nw, ns in rows[:3]), flush=True)


def bench_attn_b1(kvh: int = 8, max_len: int = 2048) -> None:
    """Paged decode attention at batch 1 (the W2 regime): latency per call by launch config.

    At batch 1 the kernel moves little data (1.5 MB at 384 tokens) and is bound by latency:
    how many dependent loads each program waits for and how many programs run. Each config
    is timed as a decode step sees it: a CUDA graph of 32 back-to-back calls (one per layer),
    each on its own KV cache so that no call finds its keys in L2 (in a real step the layer's
    weights flush it between calls). `default` is what paged_decode picks for the decode graph
    of a 2048-token context (max_seq_len = 2048), Llama-3.1-8B heads, contexts 256-1024.
    --kv-heads 4: Qwen3-30B-A3B's heads, as W2 on the MoE shape runs them (bench offline's
    max_model_len of 2,048 sizes its graphs' page table); --max-seq-len 40960: as a server with
    that model's whole context would (the split count follows the table's width, not the context)."""
    from kernels import attention

    LAYERS = 32
    H, KVH, D, PAGE = 32, kvh, 128, 16
    WIDTH = max_len // PAGE
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = WIDTH + 1
    kc = [torch.randn(pages, PAGE, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    vc = [torch.randn_like(k) for k in kc]
    pt = torch.arange(1, pages, device="cuda", dtype=torch.int32)[None, :]
    q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    configs: list[dict | None] = [None] + [
        dict(num_splits=s, block_n=bn, num_warps=w, num_stages=st)
        for s, bn, w, st in itertools.product((4, 8, 16, 32, 64), (16, 32, 64), (2, 4), (1, 3))
        if s * bn <= max_len
    ]
    for ctx in (256, 384, 1024):
        sl = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        ref = attention.paged_decode(q, kc[0], vc[0], pt, sl, 0.088, max_seq_len=max_len)
        rows = []
        for cfg in configs:
            kw = cfg or {}
            try:
                out = attention.paged_decode(q, kc[0], vc[0], pt, sl, 0.088, max_seq_len=max_len, **kw)
                if (out.float() - ref.float()).abs().max().item() > 2e-2:
                    print(f"  {kw}: WRONG", flush=True)
                    continue
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for i in range(LAYERS):
                        attention.paged_decode(q, kc[i], vc[i], pt, sl, 0.088, max_seq_len=max_len, **kw)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(LAYERS):
                        attention.paged_decode(q, kc[i], vc[i], pt, sl, 0.088, max_seq_len=max_len, **kw)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                graph.replay()
                times = []
                for _ in range(5):
                    e0.record()
                    for _ in range(20):
                        graph.replay()
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(1e3 * e0.elapsed_time(e1) / (20 * LAYERS))
                rows.append((sorted(times)[2], "default" if cfg is None else
                             f"s{kw['num_splits']} n{kw['block_n']} w{kw['num_warps']} st{kw['num_stages']}"))
                del graph
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                print(f"  {kw}: failed ({type(e).__name__})", flush=True)
        rows.sort()
        default = next(t for t, name in rows if name == "default")
        print(f"ctx {ctx:5d}: default {default:5.2f} us/call; best " + ", ".join(f"{t:.2f} {n}" for t, n in rows[:6]),
              flush=True)



def bench_attn_kv() -> None:
    """Decode attention over bf16 pages against float8 pages (kv_cache_dtype fp8) at the
    large batches of W3, by key block and warps: whether fp8 pages halve the time."""
    from kernels import attention

    for b, ctx in [(64, 2048), (256, 1500), (512, 1500)]:
        pages = (ctx + 15) // 16
        pt = torch.arange(1, b * pages + 1, device="cuda", dtype=torch.int32).view(b, pages)
        sl = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            kc = torch.randn(b * pages + 1, 16, 8, 128, device="cuda", dtype=torch.bfloat16).to(dtype)
            vc = torch.randn_like(kc, dtype=torch.bfloat16).to(dtype)
            tb = 2 * b * ctx * 8 * 128 * kc.element_size() / 1e12
            rows = []
            # (dot dtype: float8 pages convert to bf16 or fp16, block_n, num_warps, num_stages)
            computes = (torch.bfloat16, torch.float16) if dtype != torch.bfloat16 else (torch.bfloat16,)
            configs = [(c, bn, nw, ns) for c in computes for bn in (64, 128) for nw in (4, 8) for ns in (2, 3, 4)]
            for cd, bn, nw, ns in configs:
                try:
                    t = _time_us(lambda: attention.paged_decode(
                        q, kc, vc, pt, sl, 0.088, max_seq_len=4096, block_n=bn, num_warps=nw, num_stages=ns,
                        compute_dtype=cd), reps=20)
                except Exception:  # noqa: BLE001 - a config that does not fit is skipped
                    continue
                rows.append((t, f"{str(cd)[6:]} n{bn} w{nw} st{ns}"))
            base = _time_us(lambda: attention.paged_decode(q, kc, vc, pt, sl, 0.088, max_seq_len=4096))
            rows.sort()
            print(f"attn {str(dtype)[6:]:14} B={b:3d} ctx={ctx:4d}: default {base:7.1f} us ({tb / base * 1e6:4.2f} TB/s); "
                  "best " + ", ".join(f"{t:.1f}us {name}" for t, name in rows[:6]), flush=True)


def _compiled(fn):
    """The compiled variants of a Triton kernel (their regs, spills, shared memory, asm)."""
    out = []
    for cache in getattr(fn, "device_caches", {}).values():
        out.extend(cache[0].values())
    return out


def bench_attn_fp8(out_dir: str | None = None) -> None:
    """Decode attention over float8 pages at W3's batches: splits x block x warps x stages,
    with each variant's registers and shared memory (occupancy), and the TTGIR/PTX of the
    defaults written to out_dir (whether the pipeliner made the float8 loads asynchronous)."""
    from kernels import attention

    for b, ctx in [(256, 1500), (512, 1500)]:
        pages = (ctx + 15) // 16
        pt = torch.arange(1, b * pages + 1, device="cuda", dtype=torch.int32).view(b, pages)
        sl = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b * pages + 1, 16, 8, 128, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        tb = 2 * b * ctx * 8 * 128 / 1e12
        rows = []
        for splits, bn, nw, ns in itertools.product((1, 2), (32, 64, 128), (1, 2, 4), (2, 3, 4)):
            seen = {id(k) for k in _compiled(attention.decode._decode_kernel)}
            try:
                t = _time_us(lambda: attention.paged_decode(
                    q, kc, vc, pt, sl, 0.088, num_splits=splits, block_n=bn, num_warps=nw, num_stages=ns), reps=10)
            except Exception:  # noqa: BLE001 - a config that does not fit is skipped
                continue
            new = [k for k in _compiled(attention.decode._decode_kernel) if id(k) not in seen]
            info = ""
            if new:
                k = new[0]
                info = f" r{k.n_regs} sp{k.n_spills} sm{k.metadata.shared // 1024}K"
                if out_dir and b == 256 and splits == 1 and (bn, nw, ns) in ((128, 4, 3), (32, 1, 3)):
                    for kind in ("ttgir", "ptx"):
                        Path(out_dir, f"decode_fp8_n{bn}_w{nw}_st{ns}.{kind}").write_text(k.asm[kind])
            rows.append((t, f"s{splits} n{bn} w{nw} st{ns}{info}"))
        base = _time_us(lambda: attention.paged_decode(q, kc, vc, pt, sl, 0.088))
        rows.sort()
        print(f"attn-fp8 B={b} ctx={ctx}: default {base:.0f}us {tb / base * 1e6:.2f}TB/s; best " + "; ".join(f"{t:.0f}us {tb / t * 1e6:.2f}TB/s {n}" for t, n in rows[:10]))
        print("   worst: " + "; ".join(f"{t:.0f}us {n}" for t, n in rows[-4:]), flush=True)


def bench_attn_occupancy() -> None:
    """Float8 pages, one warp per program: registers (168 at 32-key blocks) cap the programs
    resident per SM; 16-key blocks and register caps (maxnreg) trade them for occupancy."""
    from kernels import attention

    for b, ctx in [(256, 1500), (480, 1500), (512, 1500)]:
        pages = (ctx + 500 + 15) // 16
        pt = torch.arange(1, b * pages + 1, device="cuda", dtype=torch.int32).view(b, pages)
        sl = torch.randint(ctx - 500, ctx + 500, (b,), device="cuda", dtype=torch.int32)  # W3's spread
        q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b * pages + 1, 16, 8, 128, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        tb = 2 * int(sl.sum()) * 8 * 128 / 1e12
        ref = attention.paged_decode(q, kc, vc, pt, sl, 0.088)
        rows = []
        for splits, bn, ns, reg in itertools.product((1, 2), (16, 32), (3,), (0, 128, 96)):  # 0: no cap
            seen = {id(k) for k in _compiled(attention.decode._decode_kernel)}
            try:
                def call():
                    return attention.paged_decode(q, kc, vc, pt, sl, 0.088, num_splits=splits, block_n=bn,
                                                  num_warps=1, num_stages=ns, maxnreg=reg)
                err = (call().float() - ref.float()).abs().max().item()
                t = _time_us(call, reps=10)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  s{splits} n{bn} st{ns} reg{reg}: {type(e).__name__}")
                continue
            new = [k for k in _compiled(attention.decode._decode_kernel) if id(k) not in seen]
            info = f" r{new[0].n_regs} sp{new[0].n_spills} sm{new[0].metadata.shared // 1024}K" if new else ""
            rows.append((t, f"s{splits} n{bn} st{ns} reg{reg}{info} err{err:.1e}"))
        base = _time_us(lambda: attention.paged_decode(q, kc, vc, pt, sl, 0.088))
        rows.sort()
        print(f"attn-occ B={b} ctx~{ctx}: default {base:.0f}us {tb / base * 1e6:.2f}TB/s; best " +
              "; ".join(f"{t:.0f}us {tb / t * 1e6:.2f}TB/s {n}" for t, n in rows[:8]), flush=True)
        print("   all: " + "; ".join(f"{t:.0f} {n}" for t, n in rows[8:]), flush=True)


def bench_attn_subtile() -> None:
    """Float8 pages at W3's batches (lengths over 1,000-2,000, longest first): the per-token
    addressed kernel over d-major V (the layout before token-major V pools) against the
    sub-tiled kernel over token-major V (a float8 PagePool's), by register cap and stages."""
    from kernels import attention

    for b in (480, 256, 64):
        pages = 2000 // 16 + 1
        pt = (torch.randperm(b * pages, device="cuda", dtype=torch.int32) + 1).view(b, pages)
        sl = torch.sort(torch.randint(1000, 2000, (b,), device="cuda", dtype=torch.int32), descending=True)[0]
        q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b * pages + 1, 16, 8, 128, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        vt = vc.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # the same values, token-major
        tb = 2 * int(sl.sum()) * 8 * 128 / 1e12
        ref = attention.paged_decode(q, kc, vc, pt, sl, 0.088, subtile=False)
        rows = []
        for name, v, kw in [("before: per-token, d-major V", vc, {"subtile": False}),
                            ("sub-tiles, d-major V", vc, {}), ("default: sub-tiles, token-major V", vt, {})] + [
                (f"token-major V, w{w} reg{r} st{st} n{bn} s{sp}", vt,
                 {"num_warps": w, "maxnreg": r, "num_stages": st, "block_n": bn, "num_splits": sp})
                for w, r, st, bn, sp in [(1, 216, 3, 32, 1), (1, 0, 2, 32, 1), (1, 0, 3, 32, 2), (1, 0, 3, 64, 1),
                                         (2, 0, 3, 32, 1), (2, 0, 3, 64, 1), (4, 0, 3, 64, 1), (4, 0, 3, 128, 1),
                                         (4, 0, 2, 128, 1), (8, 0, 3, 128, 1)]]:
            err = (attention.paged_decode(q, kc, v, pt, sl, 0.088, **kw).float() - ref.float()).abs().max().item()
            t = _time_us(lambda: attention.paged_decode(q, kc, v, pt, sl, 0.088, **kw), reps=20)
            rows.append(f"   {t:6.0f} us {tb / t * 1e6:4.2f} TB/s  {name}  (max diff {err:.1e})")
        print(f"attn-subtile B={b}, lengths 1,000-2,000 longest first:", *rows, sep="\n", flush=True)
    # prefill: 8 prompts of 1,000 tokens (a W3 mixed step's chunk), K/V already in the pages
    n, qlen = 8, 1000
    pages = qlen // 16 + 1
    pt = (torch.randperm(n * pages, device="cuda", dtype=torch.int32) + 1).view(n, pages)
    lens = torch.full((n,), qlen, device="cuda", dtype=torch.int32)
    cu = torch.arange(0, (n + 1) * qlen, qlen, device="cuda", dtype=torch.int32)
    q = torch.randn(n * qlen, 32, 128, device="cuda", dtype=torch.bfloat16)
    rows = []
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        kc = torch.randn(n * pages + 1, 16, 8, 128, device="cuda", dtype=torch.bfloat16).to(dtype)
        vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16).to(dtype)
        vt = vc.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        for name, v, sub in [("d-major V, per token", vc, False), ("d-major V, sub-tiles", vc, True),
                             ("token-major V, per token", vt, False), ("token-major V, sub-tiles", vt, True)]:
            t = _time_us(lambda: attention.paged_extend(q, kc, v, pt, lens, cu, 0.088, qlen, subtile=sub), reps=10)
            rows.append(f"   {t:6.0f} us  {str(dtype).split('.')[-1]} pages, {name}")
    print(f"attn-subtile extend, {n} prompts of {qlen} tokens:", *rows, sep="\n", flush=True)


def bench_attn_w3() -> None:
    """Attention at the shapes the kernel profile of a W3 run showed (float8 pages, token-major
    V, pages scattered over a pool of 100,000 like the engine's): decode at batch 512 x 1,190 /
    488 x 1,390 / 512 x 1,935 tokens (all sequences about one length) and 480 x 1,000-2,000,
    by variant; extend over 8 prompts of 1,000 tokens by block sizes and dot dtype."""
    from kernels import attention

    pool = 100_000
    kc = torch.randn(pool, 16, 8, 128, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    vt = torch.randn(pool, 8, 128, 16, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn).permute(0, 3, 1, 2)
    cases = [(512, 1190), (488, 1390), (512, 1935), (480, None)]  # None: 1,000-2,000, longest first
    variants = [("default", {}), ("splits 2", {"num_splits": 2}), ("maxnreg 200", {"maxnreg": 200}),
                ("maxnreg 168", {"maxnreg": 168}), ("block 64", {"block_n": 64}), ("stages 2", {"num_stages": 2}),
                ("stages 4", {"num_stages": 4}), ("head-major", {"head_major": True})]
    for b, ctx in cases:
        if ctx is None:
            sl = torch.sort(torch.randint(1000, 2000, (b,), device="cuda", dtype=torch.int32), descending=True)[0]
        else:
            sl = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        pages = 2000 // 16 + 1
        q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
        tb = 2 * int(sl.sum()) * 8 * 128 / 1e12
        for layout in ("scattered", "contiguous"):
            if layout == "scattered":
                pt = torch.randperm(pool - 1, device="cuda")[: b * pages].to(torch.int32).view(b, pages) + 1
            else:
                pt = torch.arange(1, b * pages + 1, device="cuda", dtype=torch.int32).view(b, pages)
            cells = []
            for name, kw in variants if layout == "scattered" else variants[:1]:
                try:
                    t = _time_us(lambda kw=kw: attention.paged_decode(q, kc, vt, pt, sl, 0.088, **kw), reps=20)
                    cells.append(f"{name} {t:.0f} us {tb / t * 1e6:.2f} TB/s")
                except Exception as e:  # noqa: BLE001
                    cells.append(f"{name} failed {type(e).__name__}")
            print(f"attn-w3 decode B={b} ctx={ctx or '1000-2000'} {layout}: " + "; ".join(cells), flush=True)
    n, qlen = 8, 1000
    pages = qlen // 16 + 1
    pt = torch.randperm(pool - 1, device="cuda")[: n * pages].to(torch.int32).view(n, pages) + 1
    lens = torch.full((n,), qlen, device="cuda", dtype=torch.int32)
    cu = torch.arange(0, (n + 1) * qlen, qlen, device="cuda", dtype=torch.int32)
    q = torch.randn(n * qlen, 32, 128, device="cuda", dtype=torch.bfloat16)
    flop = 4 * n * (qlen * (qlen + 1) / 2) * 32 * 128
    ref = attention.paged_extend(q, kc, vt, pt, lens, cu, 0.088, qlen)
    for cd in (torch.bfloat16, torch.float16):
        for bm, bn, w, st in [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 128, 4, 2), (128, 64, 8, 2),
                              (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 2), (128, 64, 4, 2)]:
            kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st, compute_dtype=cd)
            try:
                out = attention.paged_extend(q, kc, vt, pt, lens, cu, 0.088, qlen, **kw)
                err = (out.float() - ref.float()).abs().max().item()
                t = _time_us(lambda kw=kw: attention.paged_extend(q, kc, vt, pt, lens, cu, 0.088, qlen, **kw), reps=10)
                print(f"attn-w3 extend {str(cd)[6:]} m{bm} n{bn} w{w} st{st}: {t:.0f} us "
                      f"{flop / t / 1e6:.0f} TFLOP/s (max diff {err:.1e})", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"attn-w3 extend {str(cd)[6:]} m{bm} n{bn} w{w} st{st}: failed {type(e).__name__}: {e}"[:300])


def _fp8_decode_case(batch: int, ctx: int, pool: int = 100_000):
    """q, K and V pages, page table and lengths of a Llama-3.1-8B decode batch over float8 pages
    in a float8 PagePool's layouts (K head-major, V token-major), `ctx` tokens per sequence on
    pages scattered over a pool of `pool` pages like the engine's."""
    kc = torch.randn(pool, 8, 16, 128, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn).permute(0, 2, 1, 3)
    vt = torch.randn(pool, 8, 128, 16, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn).permute(0, 3, 1, 2)
    pages = ctx // 16 + 1
    pt = torch.randperm(pool - 1, device="cuda")[: batch * pages].to(torch.int32).view(batch, pages) + 1
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    return q, kc, vt, pt, sl


def bench_attn_one(batch: int = 512, ctx: int = 1500, reps: int = 5) -> None:
    """The default float8 decode kernel at one W3 shape (`_fp8_decode_case`), `reps` launches:
    a target for Nsight Compute (`ncu --kernel-name regex:_decode_kernel --launch-skip 2
    --launch-count 1 ...`)."""
    from kernels import attention

    q, kc, vt, pt, sl = _fp8_decode_case(batch, ctx)
    for _ in range(reps):
        attention.paged_decode(q, kc, vt, pt, sl, 0.088)
    torch.cuda.synchronize()
    t = _time_us(lambda: attention.paged_decode(q, kc, vt, pt, sl, 0.088), reps=20)
    print(f"attn-one B={batch} ctx={ctx}: {t:.0f} us, {2 * batch * ctx * 8 * 128 / t / 1e6:.2f} TB/s", flush=True)


def _power_loop(fn, seconds: float = 3.0) -> tuple[float, float, float]:
    """(us per call, mean board power in W, mean SM clock in MHz) of `fn` run back to back
    for `seconds`, power and clock read by nvidia-smi every 50 ms over the last two thirds."""
    import subprocess

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    mon = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,power.draw,clocks.sm", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE, text=True,
    )
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    e1.record()
    torch.cuda.synchronize()
    mon.terminate()
    rows = [line.split(", ") for line in mon.communicate()[0].splitlines() if line.count(",") == 2]
    rows = rows[len(rows) // 3 :]
    watts = sum(float(r[1]) for r in rows) / max(1, len(rows))
    mhz = sum(float(r[2]) for r in rows) / max(1, len(rows))
    return 1e3 * e0.elapsed_time(e1) / n, watts, mhz


def bench_power() -> None:
    """Board power and SM clock while one kernel runs back to back: W3 runs at the 700 W cap
    (SM clock ~1.5-1.7 GHz of 1.98), so the energy of each kernel, not only its time alone,
    sets the step time. Decode attention variants at 512 x 1,500 float8 tokens, a copy of the
    same bytes, bf16 pages, and the GEMMs of a decode and a mixed step."""
    from kernels import attention

    b, ctx = 512, 1500
    pages = ctx // 16 + 1
    q, kh, vt, pt, sl = _fp8_decode_case(b, ctx)
    nbytes = 2 * b * ctx * 8 * 128
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def report(name, fn, moved=None, flop=None):
        us, w, mhz = _power_loop(fn)
        extra = f", {moved / us / 1e6:.2f} TB/s" if moved else ""
        extra += f", {flop / us / 1e6:.0f} TFLOP/s" if flop else ""
        print(f"power {name}: {us:.1f} us{extra}, {w:.0f} W, SM {mhz:.0f} MHz, {w * us / 1e3:.1f} mJ per call", flush=True)

    report("copy (same bytes read + written)", lambda: dst.copy_(src), moved=nbytes)
    # K token-major, the usual layout: one program's 16 keys of a page are 16 rows 1 KB apart
    # (head-major, as a float8 PagePool holds them: 2 KB of adjacent bytes)
    kc = kh.contiguous()
    for name, kw, k_ in [("attn fp8 K token-major", {}, kc), ("attn fp8 K head-major (the pool's)", {}, kh),
                         ("attn fp8 K head-major, 2 splits", {"num_splits": 2}, kh),
                         ("attn fp8 K head-major, bf16 dots", {"compute_dtype": torch.bfloat16}, kh),
                         ("attn fp8 K head-major, maxnreg 168", {"maxnreg": 168}, kh)]:
        report(name, lambda kw=kw, k_=k_, v_=vt: attention.paged_decode(q, k_, v_, pt, sl, 0.088, **kw), moved=nbytes)
    del kc, vt, kh
    kb = torch.randn(40_000, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    vb = torch.randn(40_000, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    ptb = torch.randperm(40_000 - 1, device="cuda")[: 256 * pages].to(torch.int32).view(256, pages) + 1
    report("attn bf16 pages, batch 256",
           lambda k_=kb, v_=vb: attention.paged_decode(q[:256], k_, v_, ptb, sl[:256], 0.088), moved=nbytes)
    kb = kb.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    vb = vb.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    report("attn bf16 pages head-major, batch 256",
           lambda k_=kb, v_=vb: attention.paged_decode(q[:256], k_, v_, ptb, sl[:256], 0.088), moved=nbytes)
    del kb, vb
    for rows in (512, 8192):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16)
        report(f"gate_up GEMM, {rows} rows", lambda x=x, w=w: torch.nn.functional.linear(x, w),
               flop=2 * rows * 4096 * 28672)


def bench_attn_order() -> None:
    """Decode attention over lengths spread over 1,000-2,000 (W3) in batch order: as they
    come, longest first (the GPU starts programs in grid order, so the long ones do not form
    the tail), shortest first. float8 and bf16 pages."""
    from kernels import attention

    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        for b in (256, 480, 512):
            pages = 2000 // 16
            pt = torch.arange(1, b * pages + 1, device="cuda", dtype=torch.int32).view(b, pages)
            sl = torch.randint(1000, 2000, (b,), device="cuda", dtype=torch.int32)
            q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(b * pages + 1, 16, 8, 128, device="cuda", dtype=torch.bfloat16).to(dtype)
            vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16).to(dtype)
            tb = 2 * int(sl.sum()) * 8 * 128 * kc.element_size() / 1e12
            res = []
            for name, idx in [("as they come", torch.arange(b, device="cuda")),
                              ("longest first", torch.argsort(sl, descending=True)),
                              ("shortest first", torch.argsort(sl))]:
                s2, p2 = sl[idx].contiguous(), pt[idx].contiguous()
                t = _time_us(lambda: attention.paged_decode(q, kc, vc, p2, s2, 0.088), reps=20)
                res.append(f"{name} {t:.0f}us {tb / t * 1e6:.2f}TB/s")
            print(f"attn-order {str(dtype).split('.')[-1]} B={b}: " + "; ".join(res), flush=True)


def bench_small_ops() -> None:
    """silu_and_mul and fused add + RMSNorm at the 8B shape, by launch config: at batch 480
    they took 0.93 and 0.76 ms of a 30 ms decode step, about 3x their bytes' time."""
    from kernels import activation, norm

    for rows in (1, 480):
        xs = [torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        tb = rows * 3 * 14336 * 2 / 1e12
        res = []
        for block, nw in itertools.product((512, 1024, 2048, 4096), (2, 4, 8)):
            t = _time_graph_us([lambda x=x: activation.silu_and_mul(x, block=block, num_warps=nw) for x in xs])
            res.append((t, f"b{block} w{nw}"))
        base = _time_graph_us([lambda x=x: activation.silu_and_mul(x) for x in xs])
        res.sort()
        print(f"silu_and_mul rows={rows}: default {base:.1f}us {tb / base * 1e6:.2f}TB/s; " +
              "; ".join(f"{t:.1f}us {tb / t * 1e6:.2f}TB/s {n}" for t, n in res[:6]), flush=True)
        hs = [torch.randn(2, rows, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        tb = rows * 4 * 4096 * 2 / 1e12
        res = []
        for nw in (1, 2, 4, 8, 16):
            t = _time_graph_us([lambda h=h: norm.fused_add_rms_norm(h[0], h[1], w, 1e-5, num_warps=nw) for h in hs])
            res.append((t, f"w{nw}"))
        res.sort()
        print(f"fused_add_rms_norm rows={rows}: " + "; ".join(f"{t:.1f}us {tb / t * 1e6:.2f}TB/s {n}" for t, n in res),
              flush=True)


def bench_gemm() -> None:
    import torch.nn.functional as F

    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
              "lm_head": (4096, 128256)}
    print(f"{'gemm':8} {'M':>4} {'us':>8} {'TB/s':>6} {'TFLOP/s':>8}")
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 8, 64, 256, 480, 512):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                F.linear(x, w)
            torch.cuda.synchronize()
            reps = 50
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                F.linear(x, w)
            e1.record()
            torch.cuda.synchronize()
            us = 1e3 * e0.elapsed_time(e1) / reps
            tb = (n * k + m * k + m * n) * 2 / (us * 1e-6) / 1e12
            tf = 2 * m * n * k / (us * 1e-6) / 1e12
            print(f"{name:8} {m:4d} {us:8.1f} {tb:6.2f} {tf:8.1f}")


def bench_gemm_fp8() -> None:
    """W3's linear layers (Llama-3.1-8B) at decode (480, 512) and mixed-step (8192) rows: bf16
    F.linear against the float8 path (activation quantization, then cuBLAS's row-wise scaled
    GEMM), each timed in CUDA graphs; TFLOP/s of the GEMM alone and of quantize + GEMM."""
    import torch.nn.functional as F

    from kernels import ops

    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
    print(f"{'gemm':8} {'M':>5} {'bf16 us':>8} {'TF':>5} {'quant us':>8} {'fp8 us':>8} {'TF':>5} {'q+fp8 TF':>8}")
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        wq = w.to(torch.float8_e4m3fn)
        sw = torch.rand(1, n, device="cuda") + 0.5
        for m in (480, 512, 8192):
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            qs = [ops.quantize_rows_fp8(x) for x in xs]
            bf = _time_graph_us([lambda x=x: F.linear(x, w) for x in xs])
            qu = _time_graph_us([lambda x=x: ops.quantize_rows_fp8(x) for x in xs])
            f8 = _time_graph_us([lambda q=q: torch._scaled_mm(q[0], wq.t(), scale_a=q[1], scale_b=sw,
                                                              out_dtype=torch.bfloat16) for q in qs])
            fl = 2 * m * n * k / 1e6
            print(f"{name:8} {m:5d} {bf:8.1f} {fl / bf:5.0f} {qu:8.1f} {f8:8.1f} {fl / f8:5.0f} {fl / (qu + f8):8.0f}")


def bench_gemm_rows(rows: tuple[int, ...] | None = None) -> None:
    """bf16 F.linear (cuBLAS) by row count around W3's decode batch (~487, padded up the
    decode-graph ladder), in CUDA graphs: does the cost step with the row tiles (so padding
    within a tile is free) or grow with every row?"""
    import torch.nn.functional as F

    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
              "lm_head": (4096, 128256)}
    rows_ = rows or (256, 384, 448, 464, 480, 487, 496, 512, 528, 544, 576, 640, 768, 1024)
    total = dict.fromkeys(rows_, 0.0)
    print(f"{'M':>5} " + " ".join(f"{name:>13}" for name in shapes) + "   layer us (x32 + LM head, ms)")
    for m in rows_:
        cells = []
        for name, (k, n) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            t = _time_graph_us([lambda x=x: F.linear(x, w) for x in xs])
            total[m] += t * (32 if name != "lm_head" else 1)
            cells.append(f"{t:6.1f} ({2 * m * n * k / t / 1e6:4.0f})")
        print(f"{m:5d} " + " ".join(cells) + f"   {total[m] / 1e3:6.2f} ms/step, {total[m] / m:6.2f} us/row",
              flush=True)


def bench_gemm_layouts(rows: tuple[int, ...] = (480, 488, 496, 504, 512, 8192)) -> None:
    """The decode step's linear layers as cuBLAS sees them by call: F.linear (weight [N, K], the
    engine's), a [K, N] copy of the weight (x @ w_t), F.linear with a zero bias (the cuBLASLt
    path with an epilogue) and the transposed product (w @ x^T, output [N, M]); in CUDA graphs.
    cuBLAS picks its kernel by shape and layout: at 488-512 rows the o projection ran at ~450
    TFLOP/s inside W3 against ~750 for gate_up."""
    import torch.nn.functional as F

    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
    print(f"{'gemm':8} {'M':>5} " + " ".join(f"{v:>13}" for v in ("linear", "x @ w_t", "linear+bias", "w @ x^T")))
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w_t = w.t().contiguous()
        zero = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            variants = (
                [lambda x=x: F.linear(x, w) for x in xs],
                [lambda x=x: x @ w_t for x in xs],
                [lambda x=x: F.linear(x, w, zero) for x in xs],
                [lambda x=x: w @ x.t() for x in xs],
            )
            cells = []
            for fns in variants:
                t = _time_graph_us(fns)
                cells.append(f"{t:6.1f} ({2 * m * n * k / t / 1e6:4.0f})")
            print(f"{name:8} {m:5d} " + " ".join(cells), flush=True)


def bench_overlap(layers: int = 16) -> None:
    """Can decode attention (bound by bandwidth) hide behind the GEMMs (bound by tensor cores)?

    A decode step of W3's shape (Llama-3.1-8B layers, float8 pages over 1,000-2,000 tokens,
    token-major V) reduced to its GEMMs, SiLU-and-mul and attention, `layers` layers with
    their own weights and pages, each variant captured in one CUDA graph:
    - serial: the whole batch, one stream (today's step);
    - halves: two micro-batches one after the other, one stream (the cost of splitting);
    - 2 chains: each micro-batch's layers on its own stream, free-running;
    - pipelined: GEMMs on one stream, attention on another (optionally high priority), the
      attention of one micro-batch beside the GEMMs of the other;
    with cuBLAS told to leave N SMs free (torch's SM carveout) for the attention programs."""
    import torch.nn.functional as F

    from kernels import activation, attention

    dev, bf = "cuda", torch.bfloat16
    hid, inter, h, kvh, d = 4096, 14336, 32, 8, 128
    ws = [(torch.randn(6144, hid, device=dev, dtype=bf) * 0.02, torch.randn(hid, hid, device=dev, dtype=bf) * 0.02,
           torch.randn(2 * inter, hid, device=dev, dtype=bf) * 0.02, torch.randn(hid, inter, device=dev, dtype=bf) * 0.02)
          for _ in range(layers)]
    for b in (480, 256):
        pages = 2000 // 16 + 1
        pt = (torch.randperm(b * pages, device=dev, dtype=torch.int32) + 1).view(b, pages)
        sl = torch.sort(torch.randint(1000, 2000, (b,), device=dev, dtype=torch.int32), descending=True)[0]
        # halves interleave long and short sequences, so both get the same bytes
        order = torch.cat([torch.arange(0, b, 2, device=dev), torch.arange(1, b, 2, device=dev)])
        pt, sl = pt[order].contiguous(), sl[order].contiguous()
        kcs = [torch.randn(b * pages + 1, 16, kvh, d, device=dev, dtype=bf).to(torch.float8_e4m3fn)
               for _ in range(layers)]
        vts = [torch.randn(b * pages + 1, kvh, d, 16, device=dev, dtype=bf).to(torch.float8_e4m3fn).permute(0, 3, 1, 2)
               for _ in range(layers)]
        x0 = torch.randn(b, hid, device=dev, dtype=bf)
        half = b // 2
        parts = [(slice(0, half)), (slice(half, b))]
        keep: list = []

        def qkv(x, w):
            return F.linear(x, w[0])

        def attn(y, li, rows):
            q = y[:, : h * d].view(-1, h, d)
            o = attention.paged_decode(q, kcs[li], vts[li], pt[rows], sl[rows], 0.088, max_seq_len=2000)
            keep.append(o)
            return o

        def mlp(o, x, w):
            a = F.linear(o.view(-1, h * d), w[1]) + x
            return F.linear(activation.silu_and_mul(F.linear(a, w[2])), w[3]) + a

        def serial(parts_):
            for rows in parts_:
                x = x0[rows]
                for li, w in enumerate(ws):
                    y = qkv(x, w)
                    x = mlp(attn(y, li, rows), x, w)
                keep.append(x)

        def chains():
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(main)
            for rows, s in zip(parts, (main, side)):
                with torch.cuda.stream(s):
                    serial([rows])
            main.wait_stream(side)

        def pipelined(priority: int):
            # main: GEMMs; side: attention. Attention of micro-batch A (layer li+1) runs
            # beside the MLP of B (layer li), and B's beside A's.
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream(priority=priority)
            xs = [x0[r] for r in parts]
            done: list = [None, None]
            outs: list = [None, None]

            def launch_attn(i, li, y):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    outs[i] = attn(y, li, parts[i])
                    done[i] = torch.cuda.Event()
                    done[i].record()
                keep.append(y)

            for i in (0, 1):
                launch_attn(i, 0, qkv(xs[i], ws[0]))
            for li, w in enumerate(ws):
                for i in (0, 1):
                    main.wait_event(done[i])
                    xs[i] = mlp(outs[i], xs[i], w)
                    if li + 1 < layers:
                        launch_attn(i, li + 1, qkv(xs[i], ws[li + 1]))
            main.wait_stream(side)
            keep.extend(xs)

        def graph_us(fn) -> float:
            keep.clear()
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            keep.clear()
            with torch.cuda.graph(g):
                fn()
            for _ in range(2):
                g.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            del g
            keep.clear()
            return 1e3 * e0.elapsed_time(e1) / 5 / layers

        # the carveout reaches cuBLASLt's GEMMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET)
        carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
        rows = [("serial, whole batch", lambda: serial([slice(0, b)]), None, "cublas"),
                ("serial, whole batch, cuBLASLt", lambda: serial([slice(0, b)]), None, "cublaslt"),
                ("halves, one stream", lambda: serial(parts), None, "cublas")]
        for carve, lib in [(None, "cublas"), (None, "cublaslt"), (16, "cublaslt"), (32, "cublaslt"),
                           (48, "cublaslt")]:
            rows += [(f"2 chains, carveout {carve}, {lib}", chains, carve, lib),
                     (f"pipelined, carveout {carve}, {lib}", lambda: pipelined(0), carve, lib),
                     (f"pipelined, attention high priority, carveout {carve}, {lib}", lambda: pipelined(-1), carve,
                      lib)]
        # parts alone: what a perfect overlap would give
        gem = graph_us(lambda: [mlp(torch.zeros(half, h, d, device=dev, dtype=bf), qkv(x0[:half], w)[:, :hid], w)
                                for w in ws])
        att = graph_us(lambda: [attn(torch.zeros(half, 6144, device=dev, dtype=bf), li, parts[0])
                                for li in range(layers)])
        print(f"overlap B={b}: per layer, half batch: GEMMs+SiLU {gem:.0f} us, attention {att:.0f} us; "
              f"perfect overlap of the halves {2 * max(gem, att):.0f} us, none {2 * (gem + att):.0f} us", flush=True)
        for name, fn, carve, lib in rows:
            try:
                torch.backends.cuda.preferred_blas_library(lib)
                if carve is not None:
                    if carveout is None:
                        continue
                    carveout(carve)
                t = graph_us(fn)
                print(f"   {t:7.0f} us per layer  {name}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"   failed: {name}: {type(e).__name__}: {e}", flush=True)
            finally:
                if carveout is not None:
                    carveout(None)
                torch.backends.cuda.preferred_blas_library("cublas")
        # does the carveout reach the GEMMs at all?
        w = ws[0][2]
        xx = torch.randn(half, hid, device=dev, dtype=bf)
        for carve, lib in [(None, "cublas"), (None, "cublaslt"), (32, "cublas"), (32, "cublaslt"), (66, "cublaslt")]:
            if carve is not None and carveout is None:
                continue
            torch.backends.cuda.preferred_blas_library(lib)
            if carveout is not None:
                carveout(carve)
            print(f"   gate_up GEMM at {half} rows, carveout {carve}, {lib}: "
                  f"{_time_graph_us([lambda: F.linear(xx, w)]):.0f} us", flush=True)
        if carveout is not None:
            carveout(None)
        torch.backends.cuda.preferred_blas_library("cublas")
        kcs.clear()
        vts.clear()
        torch.cuda.empty_cache()


def profile_step(only: int | None = None, kv_cache_dtype: str = "auto", graphs: bool = False,
                 quantization: str | None = None, out: str | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile

    from streamer import LLM
    from streamer.messages import SamplingParams

    cases = [("llama-3.1-8b", 1, 384, 24), ("llama-3.1-8b", 128, 1500, 8), ("qwen3-0.6b", 136, 840, 8),
             ("llama-3.1-8b", 256, 1500, 8), ("llama-3.1-8b", 480, 1500, 6), ("qwen3-30b-a3b", 1, 384, 24), ("qwen3-30b-a3b", 128, 600, 8)]
    for model, bs, ctx, steps in cases if only is None else [cases[only]]:
        llm = LLM(str(CONFIGS / model), load_format="dummy", cuda_graphs=graphs, max_model_len=2048 if bs == 1 else 4096,
                  max_num_seqs=bs, max_num_batched_tokens=16384, kv_cache_dtype=kv_cache_dtype,
                  quantization=quantization)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 30000, (ctx,), generator=g).tolist() for _ in range(bs)]
        # prefill first (not profiled), then decode steps
        sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        llm.generate(prompts, sp)
        sp = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, sp)  # prompts cached: one short prefill, then decodes
            torch.cuda.synchronize()
        _device_table(prof, steps, f"{model} bs={bs} ctx={ctx}: decode steps (incl. one prefill)", top=26)
        _gap_table(prof, steps, top=24)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(out) / f"step_{model}_bs{bs}{'_graphs' if graphs else ''}.json"))
        llm.close()
        del llm
        torch.cuda.empty_cache()


def profile_mixed(extra_rows: int = 1) -> None:
    """W5's first token at a low rate is one step of a 512-token prompt beside the running decodes:
    11.9 ms alone and 14.1 ms with 1-5 decode rows in the server's step trace (H100, thirty-ninth
    session). Here: the step of a 512-token prompt alone, then of another beside `extra_rows` cached
    prompts whose last token each is new (the rows a decode step adds), each profiled by kernel."""
    from torch.profiler import ProfilerActivity, profile

    from streamer import LLM
    from streamer.messages import SamplingParams

    llm = LLM(str(CONFIGS / "llama-3.1-8b"), load_format="dummy", max_model_len=4096, max_num_batched_tokens=8192)
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(1000, 30000, (n,), generator=g).tolist()  # noqa: E731
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    short = [prompt(64) for _ in range(extra_rows)]
    llm.generate(short + [prompt(512)], one)  # warm-up, and the short prompts cached
    for title, batch in (("512 alone", [prompt(512)]),
                         (f"512 + {extra_rows} row(s)", [prompt(512)] + [s + prompt(1) for s in short])):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(batch, one)
            torch.cuda.synchronize()
        _device_table(prof, 1, title, top=18)
    llm.close()


def _device_table(prof, steps: int, title: str, top: int = 14) -> None:
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            totals[ev.name[:70]] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            counts[ev.name[:70]] += 1
    whole = sum(totals.values())
    print(f"\n== {title}: {steps} steps, device time {whole / 1e3:.2f} ms ({whole / 1e3 / steps:.3f} ms/step)")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / 1e3 / steps:8.3f} ms/step {100 * us / whole:5.1f}%  x{counts[name] / steps:5.1f}  {name}")


def _gap_table(prof, steps: int, top: int = 16, step_gap_us: float = 30.0) -> None:
    """The device timeline: each kernel's time, the idle time before it (gaps shorter than
    step_gap_us: within a step; a longer one is the host between steps), and its own share of the
    timeline ("adds": from the later of its start and its predecessor's end to its end), by kernel
    name. With PDL a kernel starts before its predecessor ends and waits, so its span overstates
    its cost; "adds" sums to the timeline. In CUDA graphs the gaps are what launch latency and
    ramp-up cost beyond the kernels' own time."""
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name[:60]) for ev in prof.events()
                   if ev.device_type.name == "CUDA")
    busy: dict[str, float] = collections.defaultdict(float)
    gaps: dict[str, float] = collections.defaultdict(float)
    adds: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    between = 0.0
    last_end = None
    for start, end, name in spans:
        busy[name] += end - start
        counts[name] += 1
        if last_end is not None:
            gap = max(0.0, start - last_end)
            if gap < step_gap_us:
                gaps[name] += gap
            else:
                between += gap
        adds[name] += max(0.0, end - (start if last_end is None else max(start, last_end)))
        last_end = end if last_end is None else max(last_end, end)
    if not spans:
        return
    whole = spans[-1][1] - spans[0][0]
    print(f"  timeline: {whole / 1e3 / steps:.3f} ms/step from first to last kernel; kernels "
          f"{sum(busy.values()) / 1e3 / steps:.3f}, gaps within steps {sum(gaps.values()) / 1e3 / steps:.3f}, "
          f"between steps {between / 1e3 / steps:.3f}")
    for name, us in sorted(adds.items(), key=lambda kv: -(kv[1] + gaps[kv[0]]))[:top]:
        n = counts[name]
        print(f"  adds {us / n:7.2f} us (span {busy[name] / n:7.2f}) + gap {gaps[name] / n:5.2f} us  x{n / steps:5.1f}/step"
              f"  {us / 1e3 / steps:6.3f} ms/step  {name}")


def profile_grammar(model: str, n: int = 64, tokens: int = 40) -> None:
    """Device work per step of a batch of n, unconstrained against the JSON schema of
    `streamer bench grammar` (masks deferred, jump-forward off), CUDA graphs on: which kernels and
    copies a constrained step adds."""
    from torch.profiler import ProfilerActivity, profile

    from streamer import LLM
    from streamer.bench.grammar import PROMPT, SCHEMA
    from streamer.messages import GrammarSpec, SamplingParams

    llm = LLM(model, load_format="dummy")
    llm.engine.scheduler.jump_forward = False
    spec = GrammarSpec("json_schema", __import__("json").dumps(SCHEMA))
    runs = {
        "unconstrained": [SamplingParams(max_tokens=tokens, temperature=0.7, seed=i, ignore_eos=True) for i in range(n)],
        "json": [SamplingParams(max_tokens=tokens, temperature=0.7, seed=i, grammar=spec) for i in range(n)],
    }
    for params in runs.values():  # warm-up: graphs, Triton, the grammar's compilation
        llm.generate([PROMPT] * n, params)
    for name, params in runs.items():
        torch.cuda.synchronize()
        s0 = llm.stats().steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([PROMPT] * n, params)
            torch.cuda.synchronize()
        _device_table(prof, llm.stats().steps - s0, f"{name}, batch {n}")
    llm.close()


def profile_ttft(model: str, settings: dict[str, int]) -> None:
    """Where a lone request's time to first token goes: wall time of generate(max_tokens=1)
    for one prompt of 128 and of 512 tokens, and the GPU kernel time of that step, with the
    profiler's table of the host's operators."""
    from torch.profiler import ProfilerActivity, profile

    from streamer import LLM
    from streamer.messages import SamplingParams

    llm = LLM(model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=8192, **settings)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for n in (128, 512):
        walls = []
        for rep in range(4):
            prompt = [(i * 31 + rep * 7 + n) % 30000 + 10 for i in range(n)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([prompt], one)
            walls.append(1e3 * (time.perf_counter() - t0))
        prompt = [(i * 37 + n) % 30000 + 10 for i in range(n)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], one)
            torch.cuda.synchronize()
        gpu = sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA") / 1e3
        print(f"prompt {n}: wall ms {[round(w, 1) for w in walls]}; GPU kernel time of the step {gpu:.1f} ms")
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=12)
        print("\n".join(line[:150] for line in table.splitlines()))
    llm.close()


def profile_ttft_launch(model: str, n: int = 128) -> None:
    """Host time of the runner's step for one n-token prefill, called directly (no actors):
    prepare alone, forward (which prepares again), the whole launch (forward and sampling
    queued, from the step's host milestones) and until the tokens are on the host; then a
    cProfile of a step: what the eager forward costs on the host. Then the same for a
    1-token prompt, which replays a CUDA graph."""
    import cProfile
    import pstats

    from streamer import LLM
    from streamer.messages import Batch, SamplingParams, SeqChunk

    llm = LLM(model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=8192)
    runner = llm.engine.runner
    ps = runner.pool.page_size
    for length in (n, 1):
        pages = list(range(1, 1 + -(-length // ps)))
        batch = Batch(1, [SeqChunk("probe", [(i * 13) % 30000 + 10 for i in range(length)], 0, pages, True)],
                      [SamplingParams(max_tokens=1, temperature=0)], [[]], [[]])
        for _ in range(3):
            runner.collect(runner.launch(batch))
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.prepare(batch)
            t1 = time.perf_counter()
            runner.forward(batch)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            out = runner.collect(runner.launch(batch))
            h = out.host_times
            print(f"{length} tokens: prepare {1e3 * (t1 - t0):.2f} ms, forward (incl. prepare) {1e3 * (t2 - t1):.2f}; "
                  f"a step: launch (forward + sampling) {1e3 * (h['launch_end'] - h['launch_begin']):.2f}, "
                  f"until tokens {1e3 * (h['ready'] - h['launch_begin']):.2f} ms")
        prof = cProfile.Profile()
        prof.enable()
        runner.collect(runner.launch(batch))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    # the whole pipeline (actors, tokenizer, detokenizer) around a 1-token prompt
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for length in (1, n):
        walls = []
        for rep in range(5):
            t0 = time.perf_counter()
            llm.generate([[(i * 31 + rep) % 30000 + 10 for i in range(length)]], one)
            walls.append(round(1e3 * (time.perf_counter() - t0), 2))
        print(f"generate, {length}-token prompt, 1 new token: wall ms {walls}")
    llm.close()


def profile_w1_host(n: int) -> None:
    from streamer import LLM
    from streamer.bench.offline import make_workload, run_engine, warm_up
    from streamer.bench.stacks import StackSampler

    llm = LLM(str(CONFIGS / "qwen3-0.6b"), load_format="dummy", max_model_len=2100, max_num_seqs=256,
              max_num_batched_tokens=8192)
    w = make_workload("W1", 151936, n, seed=0)
    warm_up(llm, 151936)
    with StackSampler() as s:
        t0 = time.perf_counter()
        run_engine(llm, w, "W1")
        dt = time.perf_counter() - t0
    st = llm.stats()
    print(f"W1 {n} requests: {sum(w.outputs) / dt:.0f} tok/s, {st.steps} steps, {1e3 * dt / max(1, st.steps):.2f} ms/step, "
          f"mean batch {st.mean_batch_size:.1f}")
    s.report()
    llm.close()


def profile_serve_host(n: int) -> None:
    """The server (8B shape) in this process under the stack sampler, while `bench serve`
    sends n 512-token prompts at once from a subprocess (W5 at saturation)."""
    import os
    import signal
    import subprocess

    from streamer.bench.stacks import StackSampler
    from streamer.cli import main as cli_main

    model = os.environ.get("W5_MODEL", ".gpu_assets/llama-3.1-8b-dummy")
    sampler = StackSampler(interval=0.002)

    def client() -> None:
        import urllib.request

        for _ in range(600):
            try:
                urllib.request.urlopen("http://127.0.0.1:8101/health", timeout=1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.5)
        sampler.__enter__()
        subprocess.run([sys.executable, "-m", "streamer", "bench", "serve", "--base-url", "http://127.0.0.1:8101",
                        "--workload", "random", "--input-len", "512", "--output-len", "128",
                        "--num-prompts", str(n), "--request-rate", "inf"], check=False)
        sampler.__exit__()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=client, daemon=True).start()
    try:
        cli_main(["serve", "--model", model, "--load-format", "dummy", "--max-model-len", "4096",
                  "--max-num-batched-tokens", "8192", "--port", "8101"])
    except SystemExit:
        pass
    sampler.report(top=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["gemm", "gemm-fp8", "attn", "attn-b1", "attn-kv", "attn-fp8", "attn-occ",
                                    "attn-order", "attn-subtile", "attn-w3", "attn-one", "power", "small-ops",
                                    "overlap", "gemm-rows", "gemm-layouts", "step", "mixed", "w1cpu", "serve", "grammar",
                                    "ttft"])
    p.add_argument("--kv-cache-dtype", default="auto", help="step: the engine's KV cache dtype")
    p.add_argument("--kv-heads", type=int, default=8, help="attn-b1: KV heads (32 query heads)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="attn-b1: the page table's width in tokens")
    p.add_argument("--model", default=str(CONFIGS / "llama-3.1-8b"),
                   help="grammar: a model folder with a tokenizer; ttft: the model (dummy weights)")
    p.add_argument("--launch", action="store_true", help="ttft: the runner's step alone, with a cProfile")
    p.add_argument("--set", nargs="*", default=[], help="ttft: engine settings, key=value (ints)")
    p.add_argument("-n", type=int, default=256)
    p.add_argument("--quantization", default=None, help="step: the engine's quantization (fp8)")
    p.add_argument("--graphs", action="store_true", help="step: decode steps replayed from CUDA graphs")
    p.add_argument("--out", default=None, help="attn-fp8: write the kernels' TTGIR/PTX here; step: the trace")
    p.add_argument("--rows", default=None, help="gemm-rows: comma-separated row counts")
    p.add_argument("--case", type=int, default=None, help="step: only this case (0: 8B batch 1, 1: 8B batch 128, 2: 0.6B, 3: 8B batch 256, 4: 8B batch 480, "
                        "5: Qwen3-30B-A3B batch 1, 6: Qwen3-30B-A3B batch 128)")
    a = p.parse_args()
    plain = {"gemm": bench_gemm, "attn": bench_attn, "attn-b1": lambda: bench_attn_b1(a.kv_heads, a.max_seq_len), "attn-kv": bench_attn_kv, "attn-occ": bench_attn_occupancy,
             "attn-order": bench_attn_order, "attn-subtile": bench_attn_subtile, "attn-w3": bench_attn_w3, "attn-one": bench_attn_one, "power": bench_power, "small-ops": bench_small_ops,
             "gemm-fp8": bench_gemm_fp8, "gemm-layouts": bench_gemm_layouts, "overlap": bench_overlap}
    if a.part == "gemm-rows":
        bench_gemm_rows(tuple(int(r) for r in a.rows.split(",")) if a.rows else None)
    elif a.part in plain:
        plain[a.part]()
    elif a.part == "attn-fp8":
        bench_attn_fp8(a.out)
    elif a.part == "step":
        profile_step(a.case, a.kv_cache_dtype, a.graphs, a.quantization, a.out)
    elif a.part == "mixed":
        profile_mixed()
    elif a.part == "grammar":
        profile_grammar(a.model)
    elif a.part == "serve":
        profile_serve_host(a.n)
    elif a.part == "ttft" and a.launch:
        profile_ttft_launch(a.model)
    elif a.part == "ttft":
        profile_ttft(a.model, {k: int(v) for k, v in (kv.split("=", 1) for kv in a.set)})
    else:
        profile_w1_host(a.n)


if __name__ == "__main__":
    main()
