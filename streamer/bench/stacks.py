"""A sampling profiler of every thread's Python stack (the host side of a run).

Every `interval` seconds it reads each thread's frames (sys._current_frames) and counts
the functions on the stack, self and inclusive, per thread: it shows what the scheduler,
executor and detokenizer actors spend their time on while the GPU runs.

    with StackSampler() as s:
        run()
    s.report(top=25)
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path


class StackSampler:
    """Counts, per thread, the Python functions on the stack every `interval` seconds."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.self_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.incl_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                tname = names.get(ident, str(ident))
                self.samples[tname] += 1
                seen = set()
                leaf = True
                f = frame
                while f is not None:
                    key = f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"
                    if leaf:
                        self.self_counts[tname][key] += 1
                        leaf = False
                    if key not in seen:
                        self.incl_counts[tname][key] += 1
                        seen.add(key)
                    f = f.f_back
            time.sleep(self.interval)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int = 25) -> None:
        for tname, n in self.samples.most_common():
            if n < 50:
                continue
            print(f"\n== thread {tname}: {n} samples")
            print("  self:")
            for key, c in self.self_counts[tname].most_common(top):
                print(f"    {100 * c / n:5.1f}%  {key}")
            print("  inclusive:")
            for key, c in self.incl_counts[tname].most_common(top):
                print(f"    {100 * c / n:5.1f}%  {key}")
