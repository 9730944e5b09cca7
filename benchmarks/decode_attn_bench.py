"""Paged decode attention at batch 1 (the W2 regime): latency per call by launch config.

    python3 benchmarks/decode_attn_bench.py            # Llama-3.1-8B heads, contexts 128-1024

At batch 1 the kernel moves little data (1.5 MB at 384 tokens) and is bound by latency:
how many dependent loads each program waits for and how many programs run. Each config
is timed as a decode step sees it: a CUDA graph of 32 back-to-back calls (one per layer),
each on its own KV cache so that no call finds its keys in L2 (in a real step the layer's
weights flush it between calls). `default` is what paged_decode picks for the decode graph
of a 2048-token context (max_seq_len = 2048).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import attention  # noqa: E402

LAYERS = 32
H, KVH, D, PAGE = 32, 8, 128, 16
WIDTH = 2048 // PAGE


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("decode_attn_bench: needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = WIDTH + 1
    kc = [torch.randn(pages, PAGE, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    vc = [torch.randn_like(k) for k in kc]
    pt = torch.arange(1, pages, device="cuda", dtype=torch.int32)[None, :]
    q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    configs = [None] + [
        dict(num_splits=s, block_n=bn, num_warps=w, num_stages=st)
        for s, bn, w, st in itertools.product((8, 16, 32), (16, 32, 64), (2, 4), (1, 3))
        if s * bn <= 2048
    ]
    for ctx in (256, 384, 1024):
        sl = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        ref = attention.paged_decode(q, kc[0], vc[0], pt, sl, 0.088, max_seq_len=2048)
        rows = []
        for cfg in configs:
            kw = cfg or {}
            try:
                out = attention.paged_decode(q, kc[0], vc[0], pt, sl, 0.088, max_seq_len=2048, **kw)
                if (out.float() - ref.float()).abs().max().item() > 2e-2:
                    print(f"  {kw}: WRONG", flush=True)
                    continue
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for i in range(LAYERS):
                        attention.paged_decode(q, kc[i], vc[i], pt, sl, 0.088, max_seq_len=2048, **kw)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(LAYERS):
                        attention.paged_decode(q, kc[i], vc[i], pt, sl, 0.088, max_seq_len=2048, **kw)
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


if __name__ == "__main__":
    main()
