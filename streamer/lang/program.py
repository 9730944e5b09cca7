"""@function programs: run, run_batch, streaming, and where their errors point.

  @function
  def qa(s, question):
      s += user(question)
      s += assistant(gen("answer", max_tokens=64))

  state = qa.run(question="...")            # waits; raises ProgramError on failure
  state["answer"]
  states = qa.run_batch([{...}, ...], parallel=32)   # never raises: see state.error
  state = qa.run(question="...", stream=True)         # returns at once
  for delta in state.text_iter("answer"): ...

The backend is the `backend=` argument, else the one set with set_default_backend.
A program body runs in a worker thread; run_batch runs up to `parallel` bodies
at once, so their requests are in flight together and the scheduler batches them.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streamer.lang.errors import ProgramError, where_raised
from streamer.lang.state import ProgramState, Run

_default_backend: Any = None


def set_default_backend(backend: Any) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Any:
    if _default_backend is None:
        raise RuntimeError("no backend: pass backend=... or call streamer.lang.set_default_backend(...)")
    return _default_backend


class Program:
    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.name = func.__name__
        self.file = func.__code__.co_filename
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Inside another program, `sub(s, ...)` runs this body on that state; otherwise it is run()."""
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **kwargs)
        return self.run(*args, **kwargs)

    def _start(self, backend: Any) -> ProgramState:
        return ProgramState(Run(backend or get_default_backend(), self.name))

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict[str, Any]) -> None:
        run = state._run
        try:
            state.ret = self.func(state, *args, **kwargs)
            run.sync_all()
        except ProgramError as e:
            state._error = e
        except Exception as e:  # noqa: BLE001 - reported as the program's error
            state._error = ProgramError(self.name, where_raised(e.__traceback__, self.file), e)
        finally:
            try:
                run.sync_all()  # let queued expressions finish (they are skipped after an error)
            except ProgramError as e:
                state._error = state._error or e
            run.close_all()

    def run(self, *args: Any, backend: Any = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the program. stream=False: wait, raise ProgramError if it failed.
        stream=True: return the state at once (read it with text_iter; wait() for the end)."""
        state = self._start(backend)
        if stream:
            threading.Thread(target=self._execute, args=(state, args, kwargs), daemon=True,
                             name=f"program-{self.name}").start()
            return state
        self._execute(state, args, kwargs)
        if state._error is not None:
            raise state._error
        return state

    def run_batch(self, batch: list[dict[str, Any]], *, backend: Any = None,
                  parallel: int | None = None) -> list[ProgramState]:
        """Run once per kwargs dict, up to `parallel` (default all, at most 128) at once.

        Results are in order. A program that fails does not disturb the others:
        its state carries the ProgramError (state.error; reading a variable raises it).
        """
        if not batch:
            return []
        backend = backend or get_default_backend()
        states = [self._start(backend) for _ in batch]
        workers = max(1, min(parallel or len(batch), 128, len(batch)))
        with ThreadPoolExecutor(workers, thread_name_prefix=f"program-{self.name}") as pool:
            list(pool.map(lambda sk: self._execute(sk[0], (), sk[1]), zip(states, batch)))
        return states

    async def arun(self, *args: Any, backend: Any = None, **kwargs: Any) -> ProgramState:
        """run() for async callers: the body runs in a worker thread."""
        return await asyncio.to_thread(lambda: self.run(*args, backend=backend, **kwargs))


def function(func: Callable[..., Any]) -> Program:
    """Make a program of a function whose first parameter is the state `s`."""
    return Program(func)
