"""`streamer bench <command>`: the benchmarks behind benchmarks/RESULTS.md, and readers of
the engine's diagnostic files.

  offline   the engine in-process on a named workload (W1-W5), with the transformers peer
            on the same workload in the same run (offline.py)
  serve     open-loop load against a running server, over SSE (serve.py)
  grammar   JSON-schema constrained decoding against unconstrained, batch 64 (grammar.py)
  select    W6: multiple-choice select over a shared 5-shot prefix, frontend language
            against one request at a time (multiple_choice.py)
  gemv      the batch-1 GEMV against cuBLAS at the models' shapes, GPU only (gemv.py)
  steps     summarize a STREAMER_STEP_TRACE file: device busy / idle, host lag by stage
  kernels   print the kernel tables of a STREAMER_PROFILE_STEPS run (traces.py, both)

Each module's docstring says what it measures and how. Building the parser imports no
torch: the modules import it when a command runs.
"""

from __future__ import annotations

import argparse
import importlib

COMMANDS: dict[str, tuple[str, str, str, str]] = {
    # name: (module, its add-arguments function, its main, help)
    "offline": ("offline", "add_args", "main", "in-process throughput vs the transformers peer (W1-W5)"),
    "serve": ("serve", "add_args", "main", "open-loop load against a running server"),
    "grammar": ("grammar", "add_args", "main", "JSON-schema constrained decoding against unconstrained"),
    "select": ("multiple_choice", "add_args", "main", "W6: multiple-choice select over a shared prefix"),
    "gemv": ("gemv", "add_args", "main", "batch-1 GEMV against cuBLAS at the models' shapes (GPU)"),
    "steps": ("traces", "add_steps_args", "steps_main", "summarize a STREAMER_STEP_TRACE file"),
    "kernels": ("traces", "add_kernels_args", "kernels_main", "kernel tables of a STREAMER_PROFILE_STEPS run"),
}


def _module(name: str):
    return importlib.import_module(f"streamer.bench.{COMMANDS[name][0]}")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    for name, (_, add, _, help) in COMMANDS.items():
        mod = _module(name)
        getattr(mod, add)(sub.add_parser(name, help=help, description=mod.__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter))


def main(args: argparse.Namespace) -> None:
    getattr(_module(args.bench), COMMANDS[args.bench][2])(args)
