"""ProgramState: the `s` of a program, and the interpreter behind it.

  s += text | expr        queue expr on this state and return at once
  s[name], s.text(), ...  wait for what was queued before, then read
  s.fork(n)               n copies of the state, each with its own queue
  s.text_iter(name)       text deltas as they are generated

NOTE: appending never waits. Each state owns one worker task on the backend's
loop that runs its expressions in order; the program's thread only queues
them. Reading (s[name], s.text(), fork) waits until everything queued before
has run. So `for f in s.fork(3): f += gen("x")` puts three requests in flight
at once, and the scheduler batches them.

Threads: the program body runs in its own thread (never on the loop); text,
variables and the delta log change only on the loop, under `_cond`, and the
program thread reads them after a wait on `_cond`.

After a failure the state is poisoned: later expressions are skipped and the
error (a ProgramError naming the program line that appended the failed
expression) is raised by the next read.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from streamer.lang import scoring
from streamer.lang.chat import ChatState
from streamer.lang.errors import ProgramError, Where, caller
from streamer.lang.ir import Commit, Gen, RoleBegin, RoleEnd, Select, Seq, parts_of
from streamer.messages import SamplingParams


class Run:
    """What the states of one program run share: the backend, the program's name, all its states."""

    def __init__(self, backend: Any, program: str) -> None:
        self.backend = backend
        self.program = program
        self.states: list[ProgramState] = []
        self.lock = threading.Lock()

    def sync_all(self) -> None:
        """Wait for every state; raise the first error of any of them (also of a fork never read)."""
        with self.lock:
            states = list(self.states)
        for st in states:
            st._wait_idle()
        for st in states:
            if st._error is not None:
                raise st._error

    def close_all(self) -> None:
        with self.lock:
            states = list(self.states)
        for st in states:
            st._close()


class ProgramState:
    def __init__(self, run: Run, text: str = "", variables: dict | None = None, meta: dict | None = None,
                 chat: ChatState | None = None) -> None:
        self._run = run
        self._backend = run.backend
        self._loop: asyncio.AbstractEventLoop = run.backend.loop
        self._text = text
        self._vars: dict[str, Any] = dict(variables or {})
        self._meta: dict[str, dict[str, Any]] = dict(meta or {})
        self._chat = chat or ChatState()
        self._error: ProgramError | None = None
        self._cond = threading.Condition()
        self._pending = 0
        self._log: list[tuple[str | None, str]] = []
        """Every piece of text appended, with the gen/select variable it belongs to (None: literal)."""
        self._running_var: set[str] = set()
        self._finished = False
        self._closed = False
        self.ret: Any = None
        """What the program function returned."""
        self._queue: asyncio.Queue = asyncio.Queue()
        self._worker = asyncio.run_coroutine_threadsafe(self._work(), self._loop)
        with run.lock:
            run.states.append(self)

    # ---- appending ------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        self._submit(expr, caller())
        return self

    def _submit(self, expr: Any, where: Where) -> None:
        parts_of(expr)  # a TypeError here, at the program's line
        if self._closed:
            raise RuntimeError("this program has finished; its state is read-only")
        with self._cond:
            self._pending += 1
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (expr, where))

    # ---- reading --------------------------------------------------------
    def _wait_idle(self) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            raise RuntimeError("a program must not run on the backend's event loop (use Program.arun)")
        with self._cond:
            while self._pending:
                self._cond.wait()

    def sync(self) -> ProgramState:
        """Wait until everything appended so far has run; raise the program's error if it failed."""
        self._wait_idle()
        if self._error is not None:
            raise self._error
        return self

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no variable {name!r} (have: {', '.join(sorted(self._vars)) or 'none'})")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get(self, name: str, default: Any = None) -> Any:
        self.sync()
        return self._vars.get(name, default)

    def __setitem__(self, name: str, value: Any) -> None:
        self.sync()
        self._vars[name] = value

    def text(self) -> str:
        return self.sync()._text

    def variables(self) -> dict[str, Any]:
        return dict(self.sync()._vars)

    def meta(self, name: str) -> dict[str, Any]:
        """Of a gen: prompt_tokens, completion_tokens, cached_tokens, finish_reason.
        Of a select: logprobs, tokens, normalized, cached_tokens (per choice), start."""
        self.sync()
        return self._meta[name]

    def messages(self) -> list[dict[str, Any]]:
        """The chat turns closed so far (role helpers only)."""
        return [dict(m) for m in self.sync()._chat.messages]

    @property
    def error(self) -> ProgramError | None:
        """The program's error (after it finished), or None."""
        self._wait_idle()
        return self._error

    def wait(self) -> ProgramState:
        """Wait for a program started with run(stream=True) to finish; raise its error."""
        with self._cond:
            while not self._finished:
                self._cond.wait()
        return self.sync()

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Text deltas as they are appended: all of them, or only those of the gen/select `name`.

        Without a name the iterator ends when the program ends; with one, when
        that variable is complete (or the program ends without it).
        """
        i = 0
        while True:
            with self._cond:
                while i == len(self._log) and not self._iter_done(name):
                    self._cond.wait()
                chunk, i = self._log[i:], len(self._log)
                done = self._iter_done(name)
            for var, delta in chunk:
                if delta and (name is None or var == name):
                    yield delta
            if done:
                break
        if self._error is not None and (name is None or name not in self._vars):
            raise self._error

    def _iter_done(self, name: str | None) -> bool:
        if self._finished or self._error is not None:
            return True
        return name is not None and name in self._vars and name not in self._running_var

    # ---- forks ----------------------------------------------------------
    def fork(self, n: int, commit: bool = True) -> ForkGroup:
        """n branches, each a copy of this state (text, variables, chat turns) at this point.

        commit=True first prefills the text alone (one request, one step), so
        that the branches' requests find it in the prefix cache instead of all
        computing it in the same step.
        """
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        if commit and n > 1:
            self._submit(Commit(), caller())
        self.sync()
        return ForkGroup(self, [
            ProgramState(self._run, self._text, self._vars, self._meta, self._chat.copy()) for _ in range(n)
        ])

    # ---- the interpreter (on the loop) -------------------------------------
    async def _work(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            expr, where = item
            if self._error is None:
                try:
                    await self._exec(expr)
                except Exception as e:  # noqa: BLE001 - becomes the program's error
                    self._error = e if isinstance(e, ProgramError) else ProgramError(self._run.program, where, e)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _append(self, text: str, var: str | None = None) -> None:
        with self._cond:
            self._text += text
            self._log.append((var, text))
            self._cond.notify_all()

    async def _exec(self, expr: Any) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Seq):
            for part in expr.parts:
                await self._exec(part)
        elif isinstance(expr, Gen):
            await self._gen(expr)
        elif isinstance(expr, Select):
            await self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._append(await self._chat.begin(self._backend.render_chat, expr.role, len(self._text)))
        elif isinstance(expr, RoleEnd):
            self._append(self._chat.end(expr.role, self._text))
        elif isinstance(expr, Commit):
            if self._text:
                await self._backend.complete(self._text, SamplingParams(max_tokens=1, temperature=0.0))
        else:
            raise TypeError(f"cannot append {type(expr).__name__}")

    async def _gen(self, g: Gen) -> None:
        var = g.name
        if var is not None:
            with self._cond:
                self._running_var.add(var)
                self._vars.pop(var, None)
        pieces: list[str] = []
        last = None
        try:
            async for out in self._backend.generate(self._text, g.params()):
                pieces.append(out.text)
                self._append(out.text, var)
                last = out
        finally:
            if var is not None:
                self._running_var.discard(var)
        assert last is not None
        if var is not None:
            with self._cond:
                self._vars[var] = "".join(pieces)
                self._meta[var] = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                                   "cached_tokens": last.cached_tokens, "finish_reason": last.finish_reason}
                self._cond.notify_all()

    async def _select(self, sel: Select) -> None:
        scores = await scoring.score(self._backend, self._text, sel.choices, sel.commit)
        choice = sel.choices[scores.best(sel.normalize)]
        self._append(choice, sel.name)
        if sel.name is not None:
            with self._cond:
                self._vars[sel.name] = choice
                self._meta[sel.name] = {"logprobs": scores.logprobs, "tokens": scores.tokens,
                                        "normalized": scores.normalized, "cached_tokens": scores.cached_tokens,
                                        "start": scores.start}
                self._cond.notify_all()

    # ---- end of the run -------------------------------------------------
    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"<ProgramState of {self._run.program!r}: {len(self._text)} chars, vars {sorted(self._vars)}>"


class ForkGroup:
    """The branches of a fork: index them, iterate them, `forks += expr` appends to each."""

    def __init__(self, parent: ProgramState, branches: list[ProgramState]) -> None:
        self.parent = parent
        self.branches = branches

    def __len__(self) -> int:
        return len(self.branches)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.branches)

    def __getitem__(self, i: int) -> ProgramState:
        return self.branches[i]

    def __setitem__(self, i: int, branch: ProgramState) -> None:
        # `forks[i] += expr` appends in place, then assigns the same state back
        if branch is not self.branches[i]:
            raise TypeError("a fork's branches cannot be replaced")

    def __iadd__(self, expr: Any) -> ForkGroup:
        where = caller()
        for b in self.branches:
            b._submit(expr, where)
        return self

    def join(self, *names: str) -> Any:
        """Wait for every branch (raising the first branch error). For each name, the parent
        gets s[name] = [branch[name] for each branch]; returns that list (one name),
        a dict of them (several) or None."""
        for b in self.branches:
            b.sync()
        joined = {name: [b[name] for b in self.branches] for name in names}
        for name, values in joined.items():
            self.parent[name] = values
        if len(names) == 1:
            return joined[names[0]]
        return joined or None

