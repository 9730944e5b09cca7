"""`streamer bench offline | serve`: throughput and latency benchmarks.

offline: the engine in-process on a named workload (W1-W4), with the
transformers peer on the same workload in the same run.
serve:   open-loop load against a running server (see serve.py).
"""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    from streamer.bench import offline

    offline.add_args(sub.add_parser("offline", help="in-process throughput vs the transformers peer"))
    try:
        from streamer.bench import serve
    except ImportError:
        return
    serve.add_args(sub.add_parser("serve", help="open-loop load against a running server"))


def main(args: argparse.Namespace) -> None:
    if args.bench == "offline":
        from streamer.bench import offline

        offline.main(args)
    else:
        from streamer.bench import serve

        serve.main(args)
