"""The peers `bench offline` measures beside the engine, on the same workload: transformers
(its continuous-batching generate_batch, or generate at batch 1) in this process, and vLLM
(--peer vllm) through the team's peer tool in a process of its own."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamer.bench.offline import Workload

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def run_peer(model_dir: Path, w: Workload, dtype: str) -> dict[str, Any]:
    """transformers on the same workload: generate_batch (continuous batching, paged|sdpa),
    or plain generate at batch 1. Outputs all at the mean length (generate_batch has one
    max_new_tokens)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    n = w.peer_requests
    if n == 0:
        return {}
    cfg = AutoConfig.from_pretrained(str(model_dir))
    kw: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    batch = n > 1
    if batch:
        kw["attn_implementation"] = "paged|sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, **kw).eval()
    mean_out = round(sum(w.outputs[:n]) / n)
    gen = GenerationConfig(
        max_new_tokens=mean_out, do_sample=False, eos_token_id=-1, pad_token_id=0, use_cuda_graph=False
    )
    prompts = w.prompts[:n]
    with torch.no_grad():  # generate_batch's worker thread breaks under inference_mode
        if batch:
            model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(
                max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = model.generate_batch(inputs=prompts, generation_config=gen)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            produced = sum(len(o.generated_tokens) for o in outs.values())
        else:
            ids = torch.tensor(prompts, device="cuda")
            model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=mean_out, min_new_tokens=mean_out, do_sample=False)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            produced = out.shape[1] - ids.shape[1]
    del model
    torch.cuda.empty_cache()
    res = {"requests": n, "output_tokens": produced, "seconds": dt, "output_tokens_per_s": produced / dt,
           "method": "generate_batch paged|sdpa" if batch else "generate"}
    if not batch:
        res["ms_per_output_token"] = 1e3 * dt / produced
    return res


def run_vllm_peer(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """vLLM on the same workload, through the peer tool (a process of its own: vLLM takes 90% of
    the GPU's memory, the engine's is released by then). The tool replays this checkout's
    make_workload, so both engines see the same prompts; its result dict comes back."""
    import os
    import subprocess
    import tempfile

    tool, site = Path(args.vllm_tool), Path(args.vllm_site)
    if not tool.is_file() or not site.is_dir():
        raise FileNotFoundError(
            f"--peer vllm needs the peer tool at --vllm-tool ({tool}) and its unpacked site at --vllm-site ({site}): "
            "copy ../shared/peer to .peer and run `bash .peer/vllm/run.sh install` on the GPU machine"
        )
    cmd = [sys.executable, str(tool)]
    if args.model_dir or args.tensor_parallel_size > 1:
        # what the tool lacks (another shape, tensor parallelism): benchmarks/peer_vllm.py runs it with them
        cmd = [sys.executable, str(CONFIGS.parent / "peer_vllm.py"), "--tool", str(tool),
               "--tensor-parallel-size", str(args.tensor_parallel_size)]
        if args.model_dir:
            shape = Path(args.model_dir).resolve()
            if shape.parent != CONFIGS or not (shape / "config.json").is_file():
                raise ValueError(f"--peer vllm with --model-dir takes a shape of {CONFIGS} (vLLM runs it with dummy "
                                 f"weights), not {args.model_dir}: use --no-peer for other folders")
            cmd += ["--model", shape.name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd += ["--proj", str(CONFIGS.parents[1]), "--site", str(site),
                "--workload", name, "--json", str(out), "--kv-cache-dtype", args.kv_cache_dtype]
        if args.num_requests is not None:
            cmd += ["--num-requests", str(args.num_requests)]
        if args.max_num_seqs is not None:  # only when given: otherwise each engine takes its own default
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OUT": tmp}, check=False)
        if not out.is_file():
            raise RuntimeError(f"the vLLM peer wrote no result (exit {proc.returncode}): {proc.stdout[-400:]}{proc.stderr[-400:]}")
        res = json.loads(out.read_text())[0]
    if "error" in res:
        raise RuntimeError(f"the vLLM peer failed: {str(res['error'])[:400]}")
    keep = ("engine", "vllm_version", "requests", "output_tokens", "seconds", "output_tokens_per_s",
            "ms_per_output_token", "ttft_ms", "ms_per_output_token_all", "mode", "init_seconds", "model", "engine_args")
    return {k: res[k] for k in keep if k in res}
