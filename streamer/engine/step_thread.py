"""StepThread: the one thread that builds and runs the model, for an engine's whole life.

Why one thread, made before the model and kept (on the CPU above all): torch's intra-op
parallelism there is OpenMP (libgomp), whose team of worker threads belongs to the thread
that opens a parallel region, and stays with it. Once a process holds more OpenMP threads
than CPUs (the loading thread's team plus the stepping thread's), libgomp stops letting idle
workers spin between regions (its spin count drops to 1,000), so every op of every step
waits for a futex wake-up. Loading the model on the caller's thread and stepping on a pool
thread did exactly that. Measured on 2 cores (2026-12-05): gathering 4 KV pages took 62 us
on a second thread against 7 us on the only one, and a decode step of SmolLM2-135M-Instruct
took 75.8 ms against 39.8 ms (transformers' generate: 37.6 ms).

So the runner is constructed on this thread (AsyncEngine, on the CPU), every step runs on it
(executor.run), and `close` ends it, which also ends its OpenMP team (a later engine in the
same process would otherwise share the CPUs with it). The thread takes torch's intra-op
thread count as it is when the thread starts (torch.set_num_threads before the engine).

Invariants: at most one call runs at a time, in submission order (one worker); close after
the executor has stopped (no step left to run).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class StepThread:
    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-step")

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the thread, waited for (the caller blocks)."""
        return self.pool.submit(fn, *args).result()

    def close(self) -> None:
        """The thread ends once idle (at once, when the engine has stopped). Not waited for: a
        step that hangs (a stop that timed out) must not hang the caller's close too."""
        self.pool.shutdown(wait=False, cancel_futures=True)
