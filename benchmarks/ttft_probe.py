"""Where a lone request's time to first token goes (GPU machine): wall time of
generate(max_tokens=1) for one prompt, and the GPU kernel time of that step.

    python3 benchmarks/ttft_probe.py [--model DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from streamer import LLM
    from streamer.messages import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path(__file__).parent / "configs" / "llama-3.1-8b"))
    a = ap.parse_args()
    llm = LLM(a.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=8192)
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


if __name__ == "__main__":
    main()
