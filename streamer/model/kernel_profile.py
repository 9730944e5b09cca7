"""STREAMER_PROFILE_STEPS: the device kernels of chosen steps of a real run (diagnostics).

STREAMER_PROFILE_STEPS="40,41,900" runs each listed step alone under torch.profiler and
appends one JSON line per step to STREAMER_PROFILE_OUT (default ./kernel_profile.jsonl):
step, seqs, tokens, decodes, total_us (sum of kernel times), span_us (first kernel's start
to the last one's end) and kernels: [name, count, us, gap_us] sorted by time, gap_us being
the device's idle time just before that kernel's launches. Kernels replayed from a CUDA
graph are listed one by one. On the CPU the table lists torch operators by their own
(self) CPU time instead.

Why one step at a time: the device must finish the step before it (which the profiler
would otherwise mix in) and this one before the profile stops, so a profiled step drains
the pipeline; the run's other steps are untouched. benchmarks/kernel_table.py prints the
lines as tables, by kind of step.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from streamer.messages import Batch


class StepProfiler:
    def __init__(self, steps: set[int], path: str) -> None:
        self.steps = steps
        self.path = path

    @classmethod
    def from_env(cls) -> StepProfiler | None:
        spec = os.environ.get("STREAMER_PROFILE_STEPS", "").strip()
        if not spec:
            return None
        steps = {int(s) for s in spec.split(",") if s.strip()}
        return cls(steps, os.environ.get("STREAMER_PROFILE_OUT", "kernel_profile.jsonl"))

    def wants(self, step: int) -> bool:
        return step in self.steps

    def run(self, batch: Batch, launch: Callable[[], Any]) -> Any:
        """Launch `batch` under the profiler and wait for it; write its kernel table."""
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            out = launch()
            if cuda:
                torch.cuda.synchronize()
        times: dict[str, float] = collections.defaultdict(float)
        counts: dict[str, int] = collections.defaultdict(int)
        gaps: dict[str, float] = collections.defaultdict(float)
        events = [ev for ev in prof.events() if ev.device_type.name == ("CUDA" if cuda else "CPU")]
        events.sort(key=lambda ev: ev.time_range.start)
        end = events[0].time_range.start if events else 0.0
        for ev in events:
            name = ev.name[:90]
            times[name] += ev.device_time_total if cuda else ev.self_cpu_time_total
            counts[name] += 1
            if cuda:
                # the device idle before this kernel (none when it began before the last one
                # ended, as programmatic dependent launch allows)
                gaps[name] += max(0.0, ev.time_range.start - end)
                end = max(end, ev.time_range.end)
        rec = {
            "step": batch.step,
            "seqs": len(batch.seqs),
            "tokens": sum(len(s.token_ids) for s in batch.seqs),
            "decodes": sum(len(s.token_ids) == 1 for s in batch.seqs),
            "total_us": sum(times.values()),
            "span_us": (events[-1].time_range.end - events[0].time_range.start) if cuda and events else 0.0,
            "kernels": [[n, counts[n], round(t, 1), round(gaps[n], 1)]
                        for n, t in sorted(times.items(), key=lambda kv: -kv[1])],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return out
