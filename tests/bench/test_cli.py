"""`streamer bench <command>`: every command is listed with its help and its module's
documentation, and building the parser imports neither torch nor the engine."""

from __future__ import annotations

import argparse
import subprocess
import sys

from streamer.bench import COMMANDS
from streamer.cli import build_parser


def bench_commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    return next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_bench_command_is_documented():
    commands = bench_commands()
    assert set(commands) == set(COMMANDS) >= {"offline", "serve", "grammar", "select", "gemv", "steps", "kernels"}
    for name, p in commands.items():
        assert p.description and len(p.description.splitlines()) > 2, name  # the module's docstring
        undocumented = [a.option_strings for a in p._actions if a.option_strings and not a.help]
        assert not undocumented, (name, undocumented)
        p.format_help()


def test_building_the_parser_imports_no_torch():
    code = "import sys; from streamer.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
