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
    ap.add_argument("--launch", action="store_true", help="profile runner.launch alone")
    a = ap.parse_args()
    if a.launch:
        launch_profile(a.model)
        return
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


def launch_profile(model: str, n: int = 128) -> None:
    """Host time of runner.launch for one n-token prefill, called directly (no actors),
    and a cProfile of it: what the eager forward costs on the host."""
    import cProfile
    import pstats

    from streamer import LLM
    from streamer.messages import Batch, SamplingParams, SeqChunk

    llm = LLM(model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=8192)
    runner = llm.engine.runner
    ps = runner.pool.page_size
    pages = list(range(1, 1 + -(-n // ps)))
    batch = Batch(1, [SeqChunk("probe", [(i * 13) % 30000 + 10 for i in range(n)], 0, pages, True)],
                  [SamplingParams(max_tokens=1, temperature=0)], [[]], [[]])
    for _ in range(3):
        runner.collect(runner.launch(batch))
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        launched = runner.launch(batch)
        t1 = time.perf_counter()
        runner.collect(launched)
        t2 = time.perf_counter()
        print(f"launch (host) {1e3 * (t1 - t0):.1f} ms, until tokens {1e3 * (t2 - t0):.1f} ms")
    prof = cProfile.Profile()
    prof.enable()
    runner.collect(runner.launch(batch))
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    llm.close()
