"""Record the Triton kernel launches of the interpreted kernel tests, for test_compiles.py.

    TRITON_INTERPRET=1 python -m tests.kernels.record_launches [pytest args, default tests/kernels]

runs the tests with every launch recorded (kernel, argument types, constexprs, warps, stages)
and writes, for each kernel, the launches that first set one of its branch-selecting constexprs
a new way (`branches`; up to VARIANTS) to compile_cases.json, which
tests/kernels/test_compiles.py compiles for the GPU; kernels the run did not launch keep their
cases there. Run it again (on the tests of the kernel) when a kernel's parameters change or a
kernel is added (test_compiles.py fails until then, naming the kernel).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

CASES_FILE = Path(__file__).with_name("compile_cases.json")
VARIANTS = 8
"""Launches kept per kernel at most: compile time in CI grows with it."""

LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "num_ctas", "maxnreg")


def arg_type(value) -> str | None:
    """Triton's signature type of a runtime argument, or None for one it would not take."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                      torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32", torch.int64: "i64", torch.int8: "i8",
                      torch.uint8: "u8", torch.int16: "i16", torch.bool: "i1"}[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def constexpr_value(value):
    """A constexpr as JSON: Triton dtypes as {"dtype": name}, the rest as they are."""
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"constexpr {value!r} has no JSON form")


def branches(consts: dict) -> set[tuple]:
    """What a launch's constexprs select: bools, strings and dtypes by value, numbers by whether
    they are zero (`if GROUP_K:`, `if OFFSET != 0.0`); tile sizes otherwise do not count."""
    out = set()
    for name, v in consts.items():
        if isinstance(v, (bool, str, dict)) or v is None:
            out.add((name, json.dumps(v)))
        else:
            out.add((name, v == 0))
    return out


def record(fn, args, kwargs, seen: dict[str, list[dict]]) -> None:
    import triton.language as tl

    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    sig, consts = {}, {}
    for name, p in params.items():
        value = bound.get(name, p.default)
        if p.annotation is tl.constexpr or str(p.annotation).endswith("constexpr"):
            consts[name] = constexpr_value(value)
        else:
            ty = arg_type(value)
            if ty is None:  # (None for an unused pointer: the compiler takes it as a constexpr)
                consts[name] = constexpr_value(value)
            else:
                sig[name] = ty
    case = {"sig": sig, "consts": consts, "num_warps": kwargs.get("num_warps", 4),
            "num_stages": kwargs.get("num_stages", 3)}
    key = f"{fn.__module__}:{fn.__qualname__}"
    cases = seen.setdefault(key, [])
    covered = set().union(*(branches(c["consts"]) for c in cases))
    if len(cases) < VARIANTS and (not cases or branches(consts) - covered):
        cases.append(case)


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1: the launches are recorded in the interpreter")
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, list[dict]] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        record(self.fn, args, kwargs, seen)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    code = pytest.main(["-q", "-p", "no:cacheprovider", *(argv or ["tests/kernels"])])
    kept = json.loads(CASES_FILE.read_text()) if CASES_FILE.exists() else {}
    seen = {**kept, **seen}
    lines = [f" {json.dumps(k)}: [\n" + ",\n".join(f"  {json.dumps(c)}" for c in v) + "\n ]"
             for k, v in sorted(seen.items())]
    CASES_FILE.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"{sum(len(v) for v in seen.values())} launches of {len(seen)} kernels -> {CASES_FILE}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
