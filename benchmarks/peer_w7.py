"""W7 on vLLM (the peer, ../shared/peer): the same prompts as benchmarks/spec_w7.py, one at a
time, greedy, with and without vLLM's ngram speculation. Run on the GPU machine with vLLM's
unpacked site on the path (PEER_PROJ=. bash .peer/vllm/run.sh install first):

    PYTHONPATH=.peer/site:/tmp/site:$PWD python3 benchmarks/peer_w7.py --model HF_DIR [--spec JSON]

(it takes the peer tool's environment from .peer/vllm/peer_bench.py).

One mode per process (vLLM keeps one engine per process well): without --spec the plain
engine, with it speculation. ms/token excludes the first token as spec_w7.py does: each
prompt runs once with max_tokens=1 (its time to first token) and once in full, prefix
caching off, and ms/token = (full - first) / (tokens - 1), summed over the prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF folder (the converted default model)")
    ap.add_argument("--spec", default=None, metavar="JSON", help="vLLM's speculative_config")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-mode", default="default", choices=["default", "graphs", "eager"],
                    help="as the peer tool's: graphs = CUDA graphs of decode steps without torch.compile")
    ap.add_argument("--peer", default=".peer/vllm", help="the peer tool (its environment for vLLM offline)")
    args = ap.parse_args()

    # vLLM's engine core is a subprocess that rendezvous over torch.distributed: without the peer
    # tool's environment (loopback host IP, hub offline, no flashinfer sampler) its start fails
    sys.path.insert(0, str(Path(args.peer).resolve()))
    from peer_bench import peer_env

    peer_env(Path(args.peer).resolve().parents[0] / "site")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sys.path.insert(0, str(Path(__file__).parent))
    from spec_w7 import prompts

    ps = prompts(AutoTokenizer.from_pretrained(args.model), args.num_prompts)
    spec = json.loads(args.spec) if args.spec else None
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=max(map(len, ps)) + args.max_tokens + 16,
              gpu_memory_utilization=0.5, enable_prefix_caching=False, speculative_config=spec, seed=0,
              **({"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}
                 if args.compile_mode == "graphs" else {"enforce_eager": True} if args.compile_mode == "eager" else {}))
    full = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    first = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([TokensPrompt(prompt_token_ids=ps[0])], full, use_tqdm=False)  # warm-up
    rows = []
    for p in ps:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p)], first, use_tqdm=False)
        t1 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], full, use_tqdm=False)[0].outputs[0]
        t2 = time.perf_counter()
        rows.append(dict(ids=list(out.token_ids), ttft=t1 - t0, full=t2 - t1))
    tokens = sum(max(len(r["ids"]) - 1, 0) for r in rows)
    decode = sum(r["full"] - r["ttft"] for r in rows)
    res = dict(engine="vllm", mode="spec" if spec else "plain", speculative_config=spec, prompts=len(ps),
               output_tokens=sum(len(r["ids"]) for r in rows), ms_per_token=1e3 * decode / max(tokens, 1),
               ttft_ms=1e3 * sum(r["ttft"] for r in rows) / len(rows), outputs=[r["ids"] for r in rows])
    print(f"vLLM W7 {res['mode']:5} {res['output_tokens']:6d} tokens  {res['ms_per_token']:8.2f} ms/token  "
          f"TTFT {res['ttft_ms']:7.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
