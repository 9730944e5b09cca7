"""ProgramError: a failure inside a program, located at the line of the program that caused it.

Expressions run asynchronously, after the line that appended them has
returned, so each one records where it was appended (the first frame outside
this package); an error while it runs is reported at that line. A Python
exception raised by the program's own code is located from its traceback.
"""

from __future__ import annotations

import linecache
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from streamer.errors import StreamerError

PACKAGE_DIR = str(Path(__file__).resolve().parent)


@dataclass(frozen=True, slots=True)
class Where:
    filename: str
    lineno: int

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"

    @property
    def source(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()


def _ours(filename: str) -> bool:
    return filename.startswith(PACKAGE_DIR)


def caller() -> Where:
    """The innermost frame of the call stack that is not in streamer.lang."""
    f = sys._getframe(1)
    while f.f_back is not None and _ours(f.f_code.co_filename):
        f = f.f_back
    return Where(f.f_code.co_filename, f.f_lineno)


def where_raised(tb: TracebackType | None, program_file: str) -> Where | None:
    """The innermost traceback frame in the program's own file, else the innermost outside streamer.lang."""
    frames = traceback.extract_tb(tb)
    for pick in (lambda fr: fr.filename == program_file, lambda fr: not _ours(fr.filename)):
        for fr in reversed(frames):
            if pick(fr) and fr.lineno is not None:
                return Where(fr.filename, fr.lineno)
    return None


class ProgramError(StreamerError):
    """A program failed. `where` is the program's line; `__cause__` the original error."""

    def __init__(self, program: str, where: Where | None, cause: BaseException) -> None:
        self.program, self.where, self.cause = program, where, cause
        what = f"{type(cause).__name__}: {cause}"
        if where is None:
            msg = f"program {program!r} failed: {what}"
        else:
            msg = f"program {program!r} failed at {where}: {what}"
            if where.source:
                msg += f"\n    {where.lineno} | {where.source}"
        super().__init__(msg)
        self.__cause__ = cause
