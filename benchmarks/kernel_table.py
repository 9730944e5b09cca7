"""Print the kernel tables written under STREAMER_PROFILE_STEPS (streamer/model/kernel_profile.py).

    python3 benchmarks/kernel_table.py kernel_profile.jsonl [--top 16]

One table per profiled step: its kind (decode, mixed, prefill), sequences and tokens, then
the kernels by device time with their share, count, and time per call.
"""

from __future__ import annotations

import argparse
import json


def kind(rec: dict) -> str:
    if rec["decodes"] == rec["seqs"]:
        return "decode"
    return "prefill" if rec["decodes"] == 0 else "mixed"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--top", type=int, default=16)
    a = p.parse_args()
    with open(a.path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    for r in recs:
        total = r["total_us"]
        span = r.get("span_us", 0.0)
        gaps = sum(k[3] for k in r["kernels"] if len(k) > 3)
        print(f"\n== step {r['step']}: {kind(r)}, {r['seqs']} seqs, {r['tokens']} tokens "
              f"({r['decodes']} decodes); kernels {total / 1e3:.2f} ms, span {span / 1e3:.2f} ms, "
              f"device idle between kernels {gaps / 1e3:.2f} ms")
        print("        ms  share  calls  us/call  idle before (ms)")
        for name, n, us, *gap in r["kernels"][: a.top]:
            g = f"{gap[0] / 1e3:6.3f}" if gap else "     -"
            print(f"  {us / 1e3:8.3f} {100 * us / total:5.1f}%  x{n:<4d} {us / n:8.1f}  {g}  {name}")


if __name__ == "__main__":
    main()
