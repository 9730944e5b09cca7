"""How dummy weights route a mixture of experts: the distinct experts a decode step reads, and
the distinct tokens greedy decoding emits, under streamer's dummy values (STREAMER_DUMMY_INIT
normal: N(0, 0.02), norms at 1) and under vLLM's (uniform: every weight U(-1e-3, 1e-3)).

A decode step of B tokens with top-k routing reads E * (1 - (1 - k/E)^B) experts a layer when
the routing is spread as a trained model's is; every byte floor in benchmarks/RESULTS.md assumes
that. If the dummy values make greedy decoding fall into a few token cycles, the tokens of a
step route alike and a step reads far fewer experts: a throughput figure measured that way
moves fewer bytes than the workload it names. Measured on an H100 (thirty-eighth session, the
Qwen3-30B-A3B shape, 128 requests, 128 steps), before "uniform" drew each weight from the seed
anew: 127.9 and 128.0 distinct experts a step under the two inits, 122-128 distinct tokens a
step. With the reseeding (vLLM's every-weight-of-a-shape-alike), on the CPU only so far (2
layers, bf16): ~112 of 128 at batch 32, as spread routing gives.

    python3 benchmarks/dummy_routing.py [--model-dir benchmarks/configs/qwen3-30b-a3b]
        [--layers 48] [--intermediate N] [--requests 128] [--steps 64] [--device cuda]

Each init runs in its own process (the variable is read when the weights are filled). CPU runs
take --layers 2 --intermediate 96 (bfloat16 as on the GPU, or --dtype float32): the routing depends on the tokens, which the experts' width
barely moves under either init.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_one(args: argparse.Namespace) -> dict:
    import torch

    from streamer import LLM
    from streamer.messages import SamplingParams
    from streamer.model.moe import SparseMoE

    seen: list[tuple[int, int]] = []  # (tokens, distinct experts) of each MoE block call
    mix = SparseMoE.mix

    def counting(self, x, weights, ids):
        seen.append((ids.shape[0], int(torch.unique(ids).numel())))
        return mix(self, x, weights, ids)

    SparseMoE.mix = counting  # type: ignore[method-assign]
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    if args.intermediate:
        cfg["moe_intermediate_size"] = args.intermediate
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, cfg["vocab_size"] - 10, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.requests)]
        with LLM(tmp, load_format="dummy", device=args.device, cuda_graphs=False, max_num_seqs=args.requests,
                 max_num_batched_tokens=args.requests * args.prompt_len, max_model_len=args.prompt_len + args.steps + 8,
                 dtype=args.dtype) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True))
    decode = [d for t, d in seen if t == args.requests]  # (the prefill is one step of requests * prompt_len)
    tokens = [len({o.token_ids[i] for o in outs}) for i in range(args.steps)]
    experts, top_k = cfg.get("num_experts") or cfg["num_local_experts"], cfg["num_experts_per_tok"]
    return {
        "init": os.environ.get("STREAMER_DUMMY_INIT", "normal"),
        "experts": experts,
        "spread_expectation": experts * (1 - (1 - top_k / experts) ** args.requests),
        "distinct_experts_mean": statistics.fmean(decode),
        "distinct_experts_last_steps": statistics.fmean(decode[-len(decode) // 4:]),
        "distinct_tokens_first": tokens[:4],
        "distinct_tokens_last": tokens[-4:],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(ROOT / "benchmarks/configs/qwen3-30b-a3b"))
    p.add_argument("--layers", type=int, default=0, help="fewer layers than the config's (0: the config's)")
    p.add_argument("--intermediate", type=int, default=0, help="the experts' width (0: the config's)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a child: this process's init only)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    for init in ("normal", "uniform"):
        env = dict(os.environ, STREAMER_DUMMY_INIT=init)
        out = subprocess.run([sys.executable, __file__, "--one", *sys.argv[1:]], env=env, capture_output=True,
                             text=True, check=False)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        if out.returncode or not line.startswith("{"):
            print(f"{init}: failed\n{out.stderr[-3000:]}")
            continue
        r = json.loads(line)
        print(f"{init:8} distinct experts a decode step {r['distinct_experts_mean']:6.1f} of {r['experts']} "
              f"(last quarter {r['distinct_experts_last_steps']:.1f}; spread routing: "
              f"{r['spread_expectation']:.1f}); distinct tokens a step, first {r['distinct_tokens_first']}, "
              f"last {r['distinct_tokens_last']}")


if __name__ == "__main__":
    main()
