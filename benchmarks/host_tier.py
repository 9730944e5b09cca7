"""W9: chat sessions that outlive GPU memory, with and without the host KV tier (issue 31).

    python3 benchmarks/host_tier.py [options]            # on the GPU: the 8B shape, dummy weights
    python3 benchmarks/host_tier.py --smoke              # on CPU: tiny sizes, a minute

SESSIONS sessions x TURNS turns; each turn adds NEW_TOKENS random user tokens to the history
and generates OUTPUT_TOKENS; between a session's turns it thinks for ~THINK_S seconds (the
sessions start staggered). The device pool is sized to POOL_FRACTION of the histories at
their longest, so a returning turn finds its history evicted from the device. Three runs:

  tier       the same pool and --host-kv-cache-gb (enough for every history)
  none       the same pool, no host tier (what eviction drops is recomputed)
  recompute  no prefix caching at all (every turn prefills its whole history)

Reported per run: time to first token of the returning turns (turn >= 2), p50 / p99, also for
the turns whose history is at least LONG_TOKENS (the 8k-token histories of the issue's goal),
cached tokens from the device and the host, and the host tier's write-backs / load-backs.
Before the runs: the host-to-device copy bandwidth of pinned memory (one large memcpy) and the
tier's load-back bandwidth (HostTier.load of a history's pages, staged and scattered into the
pool), both measured on this machine with CUDA events (CPU: wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from streamer.config import EngineConfig  # noqa: E402
from streamer.engine.engine import AsyncEngine  # noqa: E402
from streamer.kv.host import HostTier  # noqa: E402
from streamer.kv.pages import PagePool  # noqa: E402
from streamer.messages import GenerateRequest, SamplingParams  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def model_shape(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def kv_page_bytes(cfg: dict, page_size: int, dtype: torch.dtype) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return PagePool.bytes_per_page(cfg["num_hidden_layers"], page_size, cfg["num_key_value_heads"], head_dim, dtype)


def time_it(device: torch.device, fn) -> float:
    """Seconds fn takes on the device (CUDA events) or the host."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bandwidths(cfg: dict, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """Pinned host -> device memcpy, and the host tier's load-back of one long history."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    pages = max(args.turns * (args.new_tokens + args.output_tokens) // args.page_size, 4)
    pool = PagePool(cfg["num_hidden_layers"], pages + 1, args.page_size, cfg["num_key_value_heads"], head_dim,
                    dtype, device)
    tier = HostTier(pool, (pages + 1) * kv_page_bytes(cfg, args.page_size, dtype))
    nbytes = pages * tier.host.page_bytes
    src = tier.host.data.view(-1)[:nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # (warm)
    memcpy = min(time_it(device, lambda: dst.copy_(src, non_blocking=True)) for _ in range(3))
    host = list(range(pages))
    gpu = list(range(1, pages + 1))
    tier.load(host, gpu)

    def load() -> None:
        ev = tier.load(host, gpu)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    loaded = min(time_it(device, load) for _ in range(3))
    return {"bytes": nbytes, "pages": pages, "h2d_memcpy_GBps": nbytes / memcpy / 1e9,
            "load_back_GBps": nbytes / loaded / 1e9, "load_back_share": memcpy / loaded}


async def sessions(engine: AsyncEngine, args: argparse.Namespace, vocab: int) -> list[dict]:
    """Every turn of every session: its history length, time to first token, cached tokens."""
    turns: list[dict] = []
    rng = random.Random(0)
    seeds = [rng.randrange(1 << 30) for _ in range(args.sessions)]

    async def session(i: int) -> None:
        r = random.Random(seeds[i])
        await asyncio.sleep(i * args.think_s / max(args.sessions, 1))  # staggered starts
        history: list[int] = []
        for t in range(args.turns):
            prompt = history + [r.randrange(10, vocab - 10) for _ in range(args.new_tokens)]
            params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
            req = GenerateRequest(request_id=f"s{i}t{t}", prompt_token_ids=prompt, params=params)
            t0 = time.perf_counter()
            ttft, out, last = None, [], None
            async for o in engine.submit(req):
                if ttft is None and o.token_ids:
                    ttft = time.perf_counter() - t0
                out.extend(o.token_ids)
                last = o
            assert last is not None and last.error is None, last
            turns.append({"session": i, "turn": t, "history": len(history), "ttft": ttft,
                          "cached": last.cached_tokens, "cached_host": last.cached_host_tokens,
                          "prompt": len(prompt)})
            history = prompt + out
            await asyncio.sleep(args.think_s * (0.5 + r.random()))

    await asyncio.gather(*(session(i) for i in range(args.sessions)))
    return turns


def run(mode: str, args: argparse.Namespace, cfg: dict, dtype: torch.dtype) -> dict:
    longest = args.turns * (args.new_tokens + args.output_tokens)
    page = kv_page_bytes(cfg, args.page_size, dtype)
    live_pages = args.sessions * (longest // args.page_size + 1)
    num_pages = max(int(live_pages * args.pool_fraction), 2 * (longest // args.page_size + 2))
    host_gb = args.host_gb if args.host_gb else 1.25 * live_pages * page / (1 << 30)
    kw = dict(model=str(args.model_dir), load_format="dummy" if args.dummy else "auto", dtype=args.dtype,
              device=args.device, page_size=args.page_size, num_pages=num_pages, max_model_len=longest + 64,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    if mode == "tier":
        kw["host_kv_cache_gb"] = host_gb
    if mode == "recompute":
        kw["enable_prefix_caching"] = False

    async def main() -> tuple[list[dict], object]:
        engine = AsyncEngine(EngineConfig(**kw))
        await engine.start()
        try:
            t0 = time.perf_counter()
            turns = await sessions(engine, args, cfg["vocab_size"])
            wall = time.perf_counter() - t0
            return turns, (engine.stats(), wall)
        finally:
            await engine.stop()

    turns, (stats, wall) = asyncio.run(main())
    back = [t for t in turns if t["turn"] >= 1]
    long = [t["ttft"] for t in back if t["history"] >= args.long_tokens]
    ttft = [t["ttft"] for t in back]
    out = {"mode": mode, "num_pages": num_pages, "live_pages": live_pages, "wall_s": wall,
           "returning_ttft_p50_s": pct(ttft, 0.5), "returning_ttft_p99_s": pct(ttft, 0.99),
           "long_ttft_p50_s": pct(long, 0.5), "long_ttft_p99_s": pct(long, 0.99), "long_turns": len(long),
           "cached_tokens": sum(t["cached"] for t in back), "cached_host_tokens": sum(t["cached_host"] for t in back),
           "prompt_tokens": sum(t["prompt"] for t in back), "preemptions": stats.preemptions}
    if stats.host is not None:
        out |= {"host_gb": host_gb, "write_backs": stats.host.write_backs, "load_backs": stats.host.load_backs,
                "bytes_moved": stats.host.bytes_moved}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=ROOT / "configs" / "llama-3.1-8b")
    p.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True, help="random weights")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--think-s", type=float, default=5.0)
    p.add_argument("--pool-fraction", type=float, default=0.25, help="device pool / the histories at their longest")
    p.add_argument("--host-gb", type=float, default=0.0, help="host tier size (0: 1.25 x the histories)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--long-tokens", type=int, default=7000, help="histories counted as long (the 8k goal)")
    p.add_argument("--modes", default="tier,none,recompute", help="\"\" for the bandwidths alone")
    p.add_argument("--smoke", action="store_true", help="CPU-sized: SmolLM2 shape, 4 sessions x 3 turns")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.model_dir = ROOT / "configs" / "smollm2-135m"
        args.sessions, args.turns, args.new_tokens, args.output_tokens = 4, 3, 48, 4
        args.think_s, args.long_tokens, args.max_num_batched_tokens = 0.05, 96, 512
    cfg = model_shape(args.model_dir)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    results: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "bandwidth": bandwidths(cfg, args, device, dtype), "runs": []}
    print(json.dumps(results["bandwidth"]), flush=True)
    for mode in [m for m in args.modes.split(",") if m]:  # --modes "": the bandwidths only
        r = run(mode, args, cfg, dtype)
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
    by = {r["mode"]: r for r in results["runs"]}
    if "tier" in by and "recompute" in by:
        results["long_ttft_speedup_vs_recompute"] = by["recompute"]["long_ttft_p50_s"] / by["tier"]["long_ttft_p50_s"]
        print(f"long-history returning TTFT p50: {by['tier']['long_ttft_p50_s'] * 1e3:.1f} ms with the tier, "
              f"{by['recompute']['long_ttft_p50_s'] * 1e3:.1f} ms recomputing "
              f"({results['long_ttft_speedup_vs_recompute']:.1f}x)")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
