"""Readers of the engine's diagnostic files: `streamer bench steps` and `streamer bench kernels`.

steps FILE: a step trace (STREAMER_STEP_TRACE=FILE on any engine run), where the run's time
went step by step:

    STREAMER_STEP_TRACE=/tmp/steps.jsonl streamer serve ...   (or any engine run)
    streamer bench steps /tmp/steps.jsonl [--skip 20] [--last 160]

Device side: per kind of step (decode-only, mixed, prefill-only), how many, their mean
device time, and the device's idle time before them (only for steps built while the one
before was in flight: then an idle device waited for the host) and waiting for grammar masks.

Host side, for steps built ahead (overlap: step s is built once step s-2's output has been
processed, and must be launched before step s-1 ends on the device):
  loop lag   ready(s-2) -> process_begin(s-2): tokens on the host until the scheduler runs
  process    the scheduler's handling of that output
  to launch  processed(s-2) -> launch_begin(s): building batch s, the hop to the executor
  launch     launch_begin(s) -> launch_end(s): inputs prepared and the step queued
  l.cpu, p.cpu  the CPU time of launch and of process (wall minus CPU: waiting for the GIL)
and, for steps whose grammar masks were deferred, the chain from step s-1's tokens to
step s's sampling: ready(s-1) -> processed(s-1) -> filled(s) -> sample_begin(s) -> sample_end(s).
Each is shown as its mean over all such steps and over the late ones (idle before > 0.2 ms).

kernels FILE: the kernel tables written under STREAMER_PROFILE_STEPS (its steps' kernels,
CUDA graphs included, to STREAMER_PROFILE_OUT, default kernel_profile.jsonl): one table per
profiled step, its kind (decode, mixed, prefill), sequences and tokens, then the kernels by
device time with their share, count, time per call and the device's idle time before each.

    STREAMER_PROFILE_STEPS=300,1060 streamer bench offline ...
    streamer bench kernels kernel_profile.jsonl [--top 16]
"""

from __future__ import annotations

import argparse
import json
import statistics


def step_kind(r: dict) -> str:
    """decode (every sequence decodes), mixed, or prefill (none does)."""
    if r["decodes"] == r["seqs"]:
        return "decode"
    return "mixed" if r["decodes"] else "prefill"


def mean_ms(values: list[float]) -> str:
    return f"{1e3 * statistics.mean(values):7.2f}" if values else "      -"


def add_steps_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a file written under STREAMER_STEP_TRACE")
    p.add_argument("--skip", type=int, default=0, help="ignore the first N steps (warm-up)")
    p.add_argument("--last", type=int, default=0, help="only the last N steps")


def steps_main(a: argparse.Namespace) -> None:
    recs = [json.loads(line) for line in open(a.trace) if line.strip()]
    recs = [r for r in recs if r["step"] > a.skip][-a.last if a.last else 0 :]
    if not recs:
        raise SystemExit("no steps in the trace")
    by = {r["step"]: r for r in recs}
    wall = recs[-1]["ready"] - recs[0].get("launch_begin", recs[0]["ready"])
    dev = sum(r["device"] - r["mask_wait"] for r in recs)
    idle = sum(r["idle_before"] for r in recs if r["ahead"])
    wait = sum(r["mask_wait"] for r in recs)
    print(f"{len(recs)} steps over {wall:.3f} s: device busy {dev:.3f} s ({100 * dev / wall:.1f}%), idle with work "
          f"queued {idle:.3f} s, waiting for masks {wait:.3f} s")
    if "loop_cpu" in recs[0]:
        # the event loop thread (scheduler, detokenizer, HTTP and SSE) and the executor's launches
        loop = recs[-1]["loop_cpu"] - recs[0]["loop_cpu"]
        launches = sum(r.get("launch_cpu", 0.0) + r.get("sample_cpu", 0.0) for r in recs[1:])
        span = recs[-1]["process_begin"] - recs[0]["process_begin"]
        print(f"CPU: event loop thread {loop:.3f} s ({100 * loop / span:.0f}% of the span), launch thread "
              f"{launches:.3f} s ({100 * launches / span:.0f}%); per step {1e3 * loop / (len(recs) - 1):.2f} + "
              f"{1e3 * launches / (len(recs) - 1):.2f} ms")
    if "gc" in recs[0]:
        pauses = [r["gc"] for r in recs]
        late = [r for r in recs if r["ahead"] and r["idle_before"] > 2e-4]
        print(f"GC: {sum(r['gc_count'] for r in recs)} collections, {sum(pauses):.3f} s in all, the longest "
              f"{1e3 * max(pauses):.1f} ms; late steps with a collection since the line before: "
              f"{sum(r['gc'] > 0 for r in late)} of {len(late)}")
    print(f"\n{'kind':8} {'steps':>6} {'seqs':>6} {'tokens':>7} {'device ms':>9} {'idle ms':>8} {'late':>5} {'mask ms':>8}")
    for k in ("decode", "mixed", "prefill"):
        rs = [r for r in recs if step_kind(r) == k]
        if not rs:
            continue
        ahead = [r for r in rs if r["ahead"]]
        print(f"{k:8} {len(rs):6d} {statistics.mean(r['seqs'] for r in rs):6.0f} "
              f"{statistics.mean(r['tokens'] for r in rs):7.0f} {mean_ms([r['device'] for r in rs]):>9} "
              f"{mean_ms([r['idle_before'] for r in ahead]):>8} "
              f"{sum(r['idle_before'] > 2e-4 for r in ahead):5d} {mean_ms([r['mask_wait'] for r in rs]):>8}")

    def host_rows(rows: list[dict], label: str) -> None:
        parts: dict[str, list[float]] = {"loop lag": [], "process": [], "to launch": [], "launch": [],
                                         "launch cpu": [], "process cpu": []}
        for r in rows:
            prev = by.get(r["step"] - 2)
            if prev is None or "launch_begin" not in r:
                continue
            parts["loop lag"].append(prev["process_begin"] - prev["ready"])
            parts["process"].append(prev["processed"] - prev["process_begin"])
            parts["to launch"].append(r["launch_begin"] - prev["processed"])
            parts["launch"].append(r["launch_end"] - r["launch_begin"])
            parts["launch cpu"].append(r.get("launch_cpu", 0.0))
            parts["process cpu"].append(prev.get("process_cpu", 0.0))
        if parts["launch"]:
            print(f"  {label:22} {len(parts['launch']):5d} " + " ".join(mean_ms(v) for v in parts.values()))

    ahead = [r for r in recs if r["ahead"]]
    print("\nhost, steps built ahead (ms)  n  loop lag process to launch  launch  l.cpu  p.cpu")
    host_rows(ahead, "all")
    host_rows([r for r in ahead if r["idle_before"] > 2e-4], "late (idle > 0.2 ms)")
    deferred = [r for r in recs if "filled" in r and "sample_begin" in r and r["step"] - 1 in by]
    if deferred:
        print("\ngrammar chain (ms)          n  loop lag process    fill   to sample sample  s.cpu")
        for label, rows in (("all", deferred), ("late (wait > 0.2 ms)", [r for r in deferred if r["mask_wait"] > 2e-4])):
            if not rows:
                continue
            prev = [by[r["step"] - 1] for r in rows]
            cols = [
                [p["process_begin"] - p["ready"] for p in prev],
                [p["processed"] - p["process_begin"] for p in prev],
                [r["filled"] - p["processed"] for r, p in zip(rows, prev)],
                [r["sample_begin"] - r["filled"] for r in rows],
                [r["sample_end"] - r["sample_begin"] for r in rows],
                [r.get("sample_cpu", 0.0) for r in rows],
            ]
            print(f"  {label:22} {len(rows):5d} " + " ".join(mean_ms(c) for c in cols))



def add_kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a file written under STREAMER_PROFILE_STEPS (STREAMER_PROFILE_OUT)")
    p.add_argument("--top", type=int, default=16, help="kernels shown per step (default 16)")


def kernels_main(a: argparse.Namespace) -> None:
    with open(a.path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    for r in recs:
        total = r["total_us"]
        span = r.get("span_us", 0.0)
        gaps = sum(k[3] for k in r["kernels"] if len(k) > 3)
        print(f"\n== step {r['step']}: {step_kind(r)}, {r['seqs']} seqs, {r['tokens']} tokens "
              f"({r['decodes']} decodes); kernels {total / 1e3:.2f} ms, span {span / 1e3:.2f} ms, "
              f"device idle between kernels {gaps / 1e3:.2f} ms")
        print("        ms  share  calls  us/call  idle before (ms)")
        for name, n, us, *gap in r["kernels"][: a.top]:
            g = f"{gap[0] / 1e3:6.3f}" if gap else "     -"
            print(f"  {us / 1e3:8.3f} {100 * us / total:5.1f}%  x{n:<4d} {us / n:8.1f}  {g}  {name}")

