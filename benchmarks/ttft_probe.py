"""Where a lone request's time to first token goes (GPU machine): wall time of
generate(max_tokens=1) for one prompt, and the GPU kernel time of that step.

    python3 benchmarks/ttft_probe.py [--model DIR] [--set cuda_graph_max_tokens=0 ...]
    python3 benchmarks/ttft_probe.py --launch   (the runner alone, with a cProfile)
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
    ap.add_argument("--set", nargs="*", default=[], help="engine settings, key=value (ints)")
    a = ap.parse_args()
    if a.launch:
        launch_profile(a.model)
        return
    settings = {k: int(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    llm = LLM(a.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=8192, **settings)
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



def launch_profile(model: str, n: int = 128) -> None:
    """Host time of runner.launch for one n-token prefill, called directly (no actors),
    split into prepare / forward / sample, and a cProfile of it: what the eager forward
    costs on the host. Then the same for a 1-token prompt, which replays a CUDA graph."""
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
            logits, _ = runner.forward(batch)
            t2 = time.perf_counter()
            with torch.inference_mode():
                launched = runner._sample(batch, logits, {})
            t3 = time.perf_counter()
            runner.collect(launched)
            t4 = time.perf_counter()
            print(f"{length} tokens: prepare {1e3 * (t1 - t0):.2f} ms, forward (incl. prepare) {1e3 * (t2 - t1):.2f}, "
                  f"sample {1e3 * (t3 - t2):.2f}, until tokens {1e3 * (t4 - t0):.2f} ms")
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


if __name__ == "__main__":
    main()
