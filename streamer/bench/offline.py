"""Offline benchmarks: the engine in-process, a peer in the same run: transformers (the
default), or vLLM (--peer vllm) through the team's peer tool (../shared/peer: its
peer_bench.py and the site it unpacks), in a process of its own after the engine has
released the GPU.

  W1  Qwen3-0.6B shape, 256 requests, input and output lengths uniform in [100, 1024] (seed 0)
  W2  Llama-3.1-8B shape, batch 1, 128 prompt tokens, 256 new tokens (ms per output token)
  W3  Llama-3.1-8B shape, 1,000 requests of 1,000 input and 1,000 output tokens
  W4  prefix sharing: 32 groups x (2,000-token shared prefix + 16 distinct 64-token questions), 128 out;
      radix cache on vs off
  W5  Llama-3.1-8B shape, 64 requests of 512 prompt and 128 output tokens (what `bench serve`
      sends in benchmarks/gpu_run.sh w5, for the online/offline ratio)

Weights are random of the real shapes (dummy), EOS is ignored, so every request
produces exactly its output length. Each figure comes with the floor: the bytes
that must move over this card's device-to-device copy bandwidth (measured before the engine
starts: 4.25 TB/s on the H200), or the FLOPs over ~800 TFLOP/s. Off a GPU the H200's figure
stands in (the floor is then the H200's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from streamer.bench.peers import CONFIGS, run_peer, run_vllm_peer

BANDWIDTH = 4.25e12  # bytes/s, device-to-device copy measured on the H200 (off a GPU: `bandwidth`)
FLOPS = 800e12
MAX_NUM_SEQS = 256


@dataclass
class Workload:
    name: str
    model: str
    prompts: list[list[int]]
    outputs: list[int]
    peer_requests: int
    note: str = ""


@dataclass
class Result:
    workload: str
    requests: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    ms_per_output_token: float | None = None
    floor_seconds: float | None = None
    floor_fraction: float | None = None
    cache_hit_rate: float | None = None
    peer: dict[str, Any] = field(default_factory=dict)
    ratio_vs_peer: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def make_workload(name: str, vocab: int, n: int | None, seed: int = 0) -> Workload:
    rng = random.Random(seed)

    def rand_prompt(length: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(length)]

    if name == "W1":
        n = n or 256
        ins = [rng.randint(100, 1024) for _ in range(n)]
        outs = [rng.randint(100, 1024) for _ in range(n)]
        return Workload(name, "qwen3-0.6b", [rand_prompt(i) for i in ins], outs, peer_requests=min(n, 32))
    if name == "W2":
        return Workload(name, "llama-3.1-8b", [rand_prompt(128)], [256], peer_requests=1)
    if name == "W3":
        n = n or 1000
        return Workload(name, "llama-3.1-8b", [rand_prompt(1000) for _ in range(n)], [1000] * n, peer_requests=min(n, 8))
    if name == "W8":  # issue 30: a mixture of experts under W1's traffic
        n = n or 256
        ins = [rng.randint(100, 1024) for _ in range(n)]
        outs = [rng.randint(100, 1024) for _ in range(n)]
        return Workload(name, "qwen3-30b-a3b", [rand_prompt(i) for i in ins], outs, peer_requests=0)
    if name == "W5":  # the offline twin of `bench serve --input-len 512 --output-len 128` at saturation
        n = n or 64
        return Workload(name, "llama-3.1-8b", [rand_prompt(512) for _ in range(n)], [128] * n, peer_requests=0)
    if name == "W4":
        groups = n or 32
        prompts = []
        for _ in range(groups):
            prefix = rand_prompt(2000)
            prompts += [prefix + rand_prompt(64) for _ in range(16)]
        return Workload(name, "llama-3.1-8b", prompts, [128] * len(prompts), peer_requests=0)
    raise SystemExit(f"unknown workload {name}")


def model_bytes_and_params(llm: Any) -> tuple[int, int]:
    m = llm.engine.runner.model
    params = sum(p.numel() for p in m.parameters())
    return sum(p.numel() * p.element_size() for p in m.parameters()), params


def batch1_bytes(llm: Any) -> int:
    """The weight bytes one token's decode step reads: all of them, except the experts a
    token is not routed to (a mixture of experts reads top_k of its E experts per layer)."""
    wbytes, _ = model_bytes_and_params(llm)
    for mod in llm.engine.runner.model.modules():
        experts = getattr(mod, "experts", None)
        if hasattr(mod, "top_k") and experts is not None and hasattr(experts, "gate_up_proj"):
            e = experts.gate_up_proj.shape[0]
            nbytes = sum(p.numel() * p.element_size() for p in experts.parameters())
            wbytes -= nbytes * (e - mod.top_k) // e
    return wbytes


_bandwidths: dict[int, float] = {}


def bandwidth(device: str = "cuda") -> float:
    """Bytes per second a device-to-device copy moves on this GPU (read plus written; measured
    once per process, 1 GiB copied 20 times after a warm-up), or BANDWIDTH off a GPU."""
    import torch

    if not torch.cuda.is_available() or not device.startswith("cuda"):
        return BANDWIDTH
    index = torch.device(device).index or 0
    if index not in _bandwidths:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{index}")
        dst = torch.empty_like(src)
        dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            dst.copy_(src)
        end.record()
        end.synchronize()
        _bandwidths[index] = 2 * 20 * src.numel() / (start.elapsed_time(end) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
    return _bandwidths[index]


def floor_seconds(llm: Any, w: Workload, concurrency: int, bytes_per_s: float = BANDWIDTH) -> float:
    """Lower bound: max(bytes / bytes_per_s, flops / peak). Weights are read once per
    decode step; KV of every earlier token is read once per new token."""
    wbytes, params = model_bytes_and_params(llm)
    cfg = llm.engine.runner.hf_config
    head_dim = llm.engine.runner.model.head_dim
    kv_item = llm.engine.runner.pool.k.element_size()  # 1 with kv_cache_dtype fp8
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * kv_item
    latent = getattr(llm.engine.runner.model, "latent_cache", None)
    if latent is not None:  # MLA (model/deepseek.py): one latent of latent[0] values per token and layer
        kv_per_token = cfg.num_hidden_layers * latent[0] * kv_item
    total_out = sum(w.outputs)
    steps = max(max(w.outputs), total_out / max(concurrency, 1))
    kv = sum(kv_per_token * (len(p) * o + o * (o - 1) / 2) for p, o in zip(w.prompts, w.outputs))
    mem = (steps * wbytes + kv) / bytes_per_s
    # float8 tensor cores run twice the bf16 FLOPs (the LM head stays bf16: a small share)
    peak = FLOPS * (2 if llm.engine.runner.config.quantization == "fp8" else 1)
    flops = 2 * params * sum(len(p) + o for p, o in zip(w.prompts, w.outputs)) / peak
    return max(mem, flops)


class Progress:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label, self.t0, self.last = total, 0, label, time.monotonic(), 0.0

    def tick(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        # a terminal gets a live bar; a log gets a line every 10 s
        every = 0.5 if sys.stderr.isatty() else 10.0
        if now - self.last > every or self.done == self.total:
            self.last = now
            bar = "#" * int(30 * self.done / self.total)
            end = "" if sys.stderr.isatty() and self.done < self.total else "\n"
            line = f"{self.label} [{bar:<30}] {self.done}/{self.total} {now - self.t0:6.1f}s"
            print(("\r" if sys.stderr.isatty() else "") + line, end=end, file=sys.stderr)


async def _run_engine(llm: Any, w: Workload, label: str, lora: str | None = None
                      ) -> tuple[float, list[float], list[float]]:
    from streamer.messages import GenerateRequest, SamplingParams

    engine = llm.engine
    prog = Progress(sum(w.outputs), label)
    first: list[float] = []
    last: list[float] = []

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=w.outputs[i], temperature=0, ignore_eos=True, lora=lora)
        req = GenerateRequest(request_id=f"{label}-{i}", prompt_token_ids=w.prompts[i], params=params)
        t_first = None
        async for out in engine.submit(req):
            if t_first is None:
                t_first = time.perf_counter()
            prog.tick(len(out.token_ids))
            if out.error:
                raise RuntimeError(out.error)
        first.append(t_first or 0.0)
        last.append(time.perf_counter())

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(w.prompts))))
    return time.perf_counter() - t0, first, last


def run_engine(llm: Any, w: Workload, label: str, lora: str | None = None):
    return llm.call(_run_engine(llm, w, label, lora))


def warm_up(llm: Any, vocab: int) -> None:
    from streamer.messages import SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in (7, 100, 700)]
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))


def bench(args: argparse.Namespace, name: str) -> Result:
    from streamer import LLM
    from streamer.engine.spec.report import spec_delta
    from streamer.model.source import resolve_model

    w0 = make_workload(name, 1000, None)
    model_dir = resolve_model(args.model_dir) if args.model_dir else CONFIGS / w0.model
    cfg = json.loads((model_dir / "config.json").read_text())
    w = make_workload(name, cfg["vocab_size"], args.num_requests, seed=0)
    longest = max(len(p) + o for p, o in zip(w.prompts, w.outputs))
    max_num_seqs = args.max_num_seqs or MAX_NUM_SEQS
    common = dict(
        load_format="dummy" if args.dummy else "auto",
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        max_model_len=max(longest + 16, 2048),
        max_num_seqs=max_num_seqs,
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graphs=not args.no_cuda_graphs,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        decode_gemv=not args.no_decode_gemv,
        host_kv_cache_gb=args.host_kv_cache_gb,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=args.speculative_config,
    )
    lora = None
    if args.lora_rank:  # every request through one random adapter (bench/lora.py)
        import atexit
        import shutil
        import tempfile

        from streamer.bench.lora import random_adapter

        if args.peer:
            raise SystemExit("--lora-rank: the peers run the base model; pass --no-peer")
        folder = Path(tempfile.mkdtemp(prefix="streamer-lora-"))
        atexit.register(shutil.rmtree, folder, True)
        random_adapter(model_dir, args.lora_rank, folder)
        common["lora_modules"], lora = (f"bench={folder}",), "bench"
    bw = bandwidth()  # (before the engine takes the memory)
    llm = LLM(str(model_dir), **common)
    try:
        warm_up(llm, cfg["vocab_size"])
        s0 = llm.stats()
        dt, first, last = run_engine(llm, w, name, lora)
        stats = llm.stats()
        total = sum(w.outputs)
        res = Result(name, len(w.prompts), total, dt, total / dt, cache_hit_rate=stats.cache_hit_rate)
        if name == "W2":
            res.ms_per_output_token = 1e3 * (last[0] - first[0]) / (w.outputs[0] - 1)
            res.extra["ttft_ms"] = 1e3 * (dt - (last[0] - first[0]))
        res.floor_seconds = floor_seconds(llm, w, max_num_seqs, bw)
        res.floor_fraction = res.floor_seconds / dt
        res.extra["bandwidth_tb_s"] = bw / 1e12
        if name == "W2" and res.ms_per_output_token:
            res.extra["floor_ms_per_token"] = 1e3 * batch1_bytes(llm) / bw
            res.floor_fraction = res.extra["floor_ms_per_token"] / res.ms_per_output_token
        res.extra["engine_stats"] = {k: getattr(stats, k) for k in ("preemptions", "steps", "mean_batch_size", "max_batch_size")}
        # where the wall time went: device computing, device waiting for the host with work in flight
        for k in ("device_busy_s", "device_idle_s"):
            res.extra["engine_stats"][k] = getattr(stats, k) - getattr(s0, k)
        res.extra.update(spec_delta(s0, stats))
    finally:
        llm.close()
        del llm
    if name == "W4":
        cold = LLM(str(model_dir), enable_prefix_caching=False, **{**common, "host_kv_cache_gb": 0.0})
        try:
            warm_up(cold, cfg["vocab_size"])
            dt_off, _, _ = run_engine(cold, w, "W4-cache-off", lora)
        finally:
            cold.close()
        groups = len(w.prompts) // 16
        optimal = groups * 15 * 2000 / sum(len(p) for p in w.prompts)
        res.extra.update(cache_off_seconds=dt_off, speedup_vs_cache_off=dt_off / dt,
                         optimal_hit_rate=optimal, hit_rate_fraction_of_optimal=(res.cache_hit_rate or 0) / optimal)
    if args.peer == "vllm" or (args.peer and w.peer_requests):
        try:
            if args.peer == "vllm":
                res.peer = run_vllm_peer(args, name)
            else:
                res.peer = run_peer(model_dir, w, "bfloat16" if args.dtype == "auto" else args.dtype)
            if name == "W2" and res.ms_per_output_token:
                res.ratio_vs_peer = res.peer["ms_per_output_token"] / res.ms_per_output_token
            else:
                res.ratio_vs_peer = res.output_tokens_per_s / res.peer["output_tokens_per_s"]
        except Exception as e:  # noqa: BLE001 - the peer's failure is reported, not fatal
            res.peer = {"error": repr(e)[:500]}
    return res


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="W1,W2,W3",
                   help="comma-separated: W1 (Qwen3-0.6B shape, 256 requests, in/out 100-1024), W2 (Llama-3.1-8B "
                        "shape, batch 1, 128 in / 256 out), W3 (8B, 1,000 x 1,000 in / 1,000 out), W4 (8B, 32 groups "
                        "of 16 sharing a 2,000-token prefix), W5 (8B, 64 x 512 in / 128 out), W8 (Qwen3-30B-A3B "
                        "shape under W1's traffic); W6 is `bench select`, W7 and W9 are scripts in benchmarks/")
    p.add_argument("--model-dir", default=None, help="override the workload's config folder (a folder or a .gguf file)")
    p.add_argument("--num-requests", type=int, default=None, help="override the request count (W4: groups)")
    p.add_argument("--dtype", default="auto", help="weights and activations (auto: bfloat16 on CUDA)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: float8 KV pages")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="float8 linear layers (W8A8)")
    p.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True, help="random weights")
    p.add_argument("--peer", nargs="?", const="transformers", default="transformers", choices=["transformers", "vllm"],
                   help="the peer run after the engine, on the same workload (vllm: through --vllm-tool)")
    p.add_argument("--no-peer", dest="peer", action="store_const", const=None, help="no peer")
    p.add_argument("--vllm-tool", default=".peer/vllm/peer_bench.py", help="--peer vllm: the peer tool's runner")
    p.add_argument("--vllm-site", default=".peer/site", help="--peer vllm: where the tool unpacked vLLM")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"cap on running requests (default {MAX_NUM_SEQS}; the vLLM peer gets it only when given)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.85, help="share of GPU memory for weights + KV")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    p.add_argument("--no-cuda-graphs", action="store_true", help="every step eager")
    p.add_argument("--cuda-graph-max-bs", type=int, default=512,
                   help="largest decode batch replayed from a graph (capped at --max-num-seqs)")
    p.add_argument("--no-decode-gemv", action="store_true", help="cuBLAS for the linear layers at batch 1")
    p.add_argument("--host-kv-cache-gb", type=float, default=0.0, help="host KV tier under the prefix cache (0: off)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model is sharded over")
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--lora-rank", type=int, default=0,
                   help="every request through a random LoRA adapter of this rank on every layer's projections "
                        "(attention's only for a mixture of experts); 0: none")
    p.add_argument("--json", default=None, help="write results here")


def print_table(results: list[Result]) -> None:
    rates = sorted({r.extra["bandwidth_tb_s"] for r in results if "bandwidth_tb_s" in r.extra})
    if rates:
        print("floor% against " + ", ".join(f"{b:.2f}" for b in rates) + " TB/s of copy bandwidth (this GPU's, "
              "measured; the H200's off a GPU)")
    print(f"{'workload':8} {'reqs':>5} {'out tok/s':>10} {'ms/tok':>7} {'floor%':>7} {'peer tok/s':>10} {'ratio':>6}")
    for r in results:
        peer = r.peer.get("output_tokens_per_s")
        print(
            f"{r.workload:8} {r.requests:5d} {r.output_tokens_per_s:10.0f} "
            f"{(r.ms_per_output_token or 0):7.2f} {100 * (r.floor_fraction or 0):6.1f}% "
            f"{(peer or 0):10.0f} {(r.ratio_vs_peer or 0):6.2f}"
        )
        if "spec_acceptance_rate" in r.extra:
            print(f"{'':8} speculation: acceptance rate {r.extra['spec_acceptance_rate']:.2f}, "
                  f"mean accepted length {r.extra['spec_mean_accepted_length']:.2f} tokens per verify")


def main(args: argparse.Namespace) -> None:
    results = []
    for name in args.workload.split(","):
        r = bench(args, name.strip())
        results.append(r)
        print(json.dumps(asdict(r)), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(x) for x in results], indent=2))
    print_table(results)
