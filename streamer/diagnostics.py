"""Diagnostics: what the engine can report about its own steps, off unless asked for.

One Diagnostics object per engine, built from config.DiagnosticsConfig (the environment,
read once when the engine is built); the engine reaches it through a few hooks, each of
which returns at once when its switch is off:

  on_start(cuda, log)          STREAMER_LOG_COMPILES: log every Triton variant built from now on
  on_mask_fill(step)           } STREAMER_STEP_TRACE=path: one JSON line per step (StepTrace)
  on_step(batch, out, ...)     }   (the scheduler calls both)
  profile_steps / profile()    STREAMER_PROFILE_STEPS: chosen steps under torch.profiler
                               (StepProfiler; the model runner checks the step, then calls)

A low module: it imports messages and config only (torch and kernels lazily), so the
scheduler and the model runner both use it.
"""

from __future__ import annotations

import collections
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec

from streamer.config import DiagnosticsConfig
from streamer.messages import Batch, StepOutput


class Diagnostics:
    def __init__(self, config: DiagnosticsConfig | None = None) -> None:
        self.config = config if config is not None else DiagnosticsConfig()
        c = self.config
        self.trace = StepTrace(c.step_trace) if c.step_trace else None
        self.profile_steps = c.profile_steps
        """Steps run under the profiler (empty: none); the runner tests membership per step."""
        self.profiler = StepProfiler(c.profile_steps, c.profile_out) if c.profile_steps else None

    @classmethod
    def from_env(cls) -> Diagnostics:
        return cls(DiagnosticsConfig.from_env())

    def on_start(self, cuda: bool, log: Any) -> None:
        """The engine started: on CUDA, log Triton's compilations if asked (STREAMER_LOG_COMPILES)."""
        if cuda and self.config.log_compiles:
            from kernels.common import log_compiles

            log_compiles(log)

    def on_mask_fill(self, step: int) -> None:
        """The scheduler filled the deferred grammar masks of `step`."""
        if self.trace is not None:
            self.trace.filled[step] = time.perf_counter()

    def on_step(self, batch: Batch, out: StepOutput, ahead: bool, process_begin: float, loop_cpu: float) -> None:
        """The scheduler processed `out`, the output of `batch` (its handling began at
        perf_counter `process_begin`, with the loop thread's CPU clock at `loop_cpu`)."""
        if self.trace is not None:
            self.trace.write(batch, out, ahead, process_begin, loop_cpu)

    def profile(self, batch: Batch, launch: Callable[[], Any]) -> Any:
        """Launch a step of `profile_steps` under the profiler and write its kernel table."""
        assert self.profiler is not None
        return self.profiler.run(batch, launch)


def _shape(batch: Batch) -> dict[str, int]:
    return {
        "step": batch.step,
        "seqs": len(batch.seqs),
        "tokens": sum(len(s.token_ids) for s in batch.seqs),
        "decodes": sum(len(s.token_ids) == 1 for s in batch.seqs),
    }


class StepTrace:
    """STREAMER_STEP_TRACE=path: one JSON line per step as its output is processed, to see
    where a run's time goes (`streamer bench steps` summarizes a file). Times are
    time.perf_counter() seconds; device times are CUDA event measurements.

    Fields: step, seqs, tokens (computed this step), decodes (one-token chunks), ahead
    (built while the step before was in flight), device, idle_before, mask_wait, the
    executor's host milestones (launch_begin, launch_end, sample_begin, sample_end, ready),
    filled (its grammar masks were sent, masks_deferred), process_begin and processed (the
    scheduler's handling of its output); *_cpu: CPU seconds of launch, sample and process;
    loop_cpu: the event loop thread's CPU clock (time.thread_time) as process began; gc,
    gc_count: the cyclic collector's pauses since the line before (seconds, collections).
    """

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered, open for the engine's life
        self.filled: dict[int, float] = {}
        self.encoder = msgspec.json.Encoder()
        self.gc_s = 0.0
        """Seconds the cyclic GC ran (every thread stopped) since the last line."""
        self.gc_count = 0
        self._gc_began = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_began
            self.gc_count += 1

    def write(self, batch: Batch, out: StepOutput, ahead: bool, process_begin: float, loop_cpu: float) -> None:
        rec: dict[str, Any] = {
            **_shape(batch),
            "ahead": ahead,
            "device": out.device_time,
            "idle_before": out.idle_before,
            "mask_wait": out.mask_wait,
            **out.host_times,
            "process_begin": process_begin,
            "process_cpu": time.thread_time() - loop_cpu,
            "loop_cpu": loop_cpu,
            "processed": time.perf_counter(),
            "gc": self.gc_s,
            "gc_count": self.gc_count,
        }
        self.gc_s, self.gc_count = 0.0, 0
        filled = self.filled.pop(batch.step, None)
        if filled is not None:
            rec["filled"] = filled
        self.file.write(self.encoder.encode(rec).decode() + "\n")


class StepProfiler:
    """STREAMER_PROFILE_STEPS="40,41,900": the device kernels of chosen steps of a real run.

    Each listed step runs alone under torch.profiler and appends one JSON line to
    STREAMER_PROFILE_OUT (default ./kernel_profile.jsonl): step, seqs, tokens, decodes,
    total_us (sum of kernel times), span_us (first kernel's start to the last one's end)
    and kernels: [name, count, us, gap_us] sorted by time, gap_us being the device's idle
    time just before that kernel's launches. Kernels replayed from a CUDA graph are listed
    one by one. On the CPU the table lists torch operators by their own (self) CPU time
    instead.

    Why one step at a time: the device must finish the step before it (which the profiler
    would otherwise mix in) and this one before the profile stops, so a profiled step drains
    the pipeline; the run's other steps are untouched. `streamer bench kernels` prints the
    lines as tables, by kind of step.
    """

    def __init__(self, steps: frozenset[int], path: str) -> None:
        self.steps = steps
        self.path = path

    def run(self, batch: Batch, launch: Callable[[], Any]) -> Any:
        """Launch `batch` under the profiler and wait for it; write its kernel table."""
        import torch
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
            **_shape(batch),
            "total_us": sum(times.values()),
            "span_us": (events[-1].time_range.end - events[0].time_range.start) if cuda and events else 0.0,
            "kernels": [[n, counts[n], round(t, 1), round(gaps[n], 1)]
                        for n, t in sorted(times.items(), key=lambda kv: -kv[1])],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return out
