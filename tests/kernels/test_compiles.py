"""Every Triton kernel compiles for the GPU (sm_90a) on a machine without one: Triton's front
end and ptxas run ahead of time. The interpreter (every other CPU test) runs a kernel's Python
and accepts what the compiler refuses, such as a module-level float read inside @triton.jit
(the compiler wants a constexpr): this catches that before device time is spent.

The cases are launches the interpreted kernel tests made (compile_cases.json, written by
tests/kernels/record_launches.py: the first few distinct ones of each kernel), compiled as the
GPU launches them: INTERP off, PDL on, pointers 16-byte aligned, 16-bit operands multiplied as
16-bit. Launches the interpreter cannot make are written by hand in compile_cases_gpu.json, which
the recorder never rewrites: float8 tensor-core dots (the interpreter multiplies in fp32) and
decode's tiles at a model's sizes. The compiler runs in a child process: this one has
TRITON_INTERPRET set (conftest.py), under which @triton.jit makes interpreted functions."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.kernels.record_launches import CASES_FILE

GPU_CASES_FILE = CASES_FILE.with_name("compile_cases_gpu.json")
"""Hand-written cases (same format): the GPU's own variants of kernels whose interpreted launches differ."""
ROOT = Path(__file__).resolve().parents[2]
GPU_CONSTS = {"INTERP": False, "PDL": True}
"""Constexprs the interpreter launches with one value and the GPU with another."""


def kernels_in_package() -> set[str]:
    """module:name of every @triton.jit function named *_kernel under kernels/ (the launched ones;
    helpers are compiled inside them)."""
    found = set()
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith("jit") for d in node.decorator_list):
                found.add(f"{module}:{node.name}")
    return found


def _kernel(where: str):
    import importlib

    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def _compile(kernel, case: dict):
    """One case compiled for sm_90a as the GPU launches it (in a process without TRITON_INTERPRET)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {k: tl.core.dtype(v["dtype"]) if isinstance(v, dict) else v for k, v in case["consts"].items()}
    consts.update({k: v for k, v in GPU_CONSTS.items() if k in consts})
    # constexprs a case leaves out (recorded before the kernel had them) take their defaults,
    # as a launch that does not pass them does
    consts.update({p.name: p.default for p in kernel.params
                   if p.is_constexpr and p.has_default and p.name not in consts and p.name not in case["sig"]})
    first = next(t for t in case["sig"].values() if t.startswith("*"))
    if consts.get("COMPUTE") == tl.float32 and first in ("*bf16", "*fp16"):
        # the interpreter's dots widen 16-bit operands to fp32; the GPU multiplies them on the
        # tensor cores as they are (each kernel's host code: fp32 only for fp32 inputs)
        consts["COMPUTE"] = tl.core.dtype(first[1:])
        if "PRECISION" in consts:
            consts["PRECISION"] = "tf32"
    # pointers 16-byte aligned, as a launch with torch's allocations specializes them (their loads
    # then vectorize and pipeline: the code the GPU runs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if case["sig"].get(a, "").startswith("*") and a not in kernel.do_not_specialize_on_alignment}
    src = ASTSource(fn=kernel, signature={**case["sig"], **{c: "constexpr" for c in consts}}, constexprs=consts,
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": case["num_warps"], "num_stages": case["num_stages"]})


def compile_all() -> None:
    """Compile every case (in a process without TRITON_INTERPRET); print one line per case."""
    recorded, by_hand = json.loads(CASES_FILE.read_text()), json.loads(GPU_CASES_FILE.read_text())
    for where in sorted(set(recorded) | set(by_hand)):
        kernel = _kernel(where)
        for i, case in enumerate(recorded.get(where, []) + by_hand.get(where, [])):
            try:
                _compile(kernel, case)
            except Exception as e:  # noqa: BLE001 - the child reports, the test asserts
                print(f"FAILED {where} case {i}: {type(e).__name__}: {str(e)[-800:]}", flush=True)
                continue
            print(f"ok {where} case {i}", flush=True)


def test_every_kernel_has_recorded_launches():
    cases = json.loads(CASES_FILE.read_text())
    missing = kernels_in_package() - set(cases)
    assert not missing, (f"kernels no recorded launch covers: {sorted(missing)}; run "
                         "TRITON_INTERPRET=1 python -m tests.kernels.record_launches")


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.kernels.test_compiles import compile_all; compile_all()"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert not failed, "\n".join(failed)
    assert run.stdout.count("\nok ") + run.stdout.startswith("ok ") == sum(
        len(v) for f in (CASES_FILE, GPU_CASES_FILE) for v in json.loads(f.read_text()).values())


def ptx_of_first_cases(wheres: list[str]) -> None:
    """Print {kernel: sm_90a PTX of its first hand-written case} as JSON (in a child without
    TRITON_INTERPRET)."""
    by_hand = json.loads(GPU_CASES_FILE.read_text())
    print(json.dumps({w: _compile(_kernel(w), by_hand[w][0]).asm["ptx"] for w in wheres}))


def test_decode_weights_are_prefetched_before_the_pdl_wait():
    """The decode GEMVs ask L2 for their first weight bytes while the kernel before them finishes:
    the prefetch must come before griddepcontrol.wait in the code the GPU runs (a compiler that
    moved it after the wait would keep the results and lose the point)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    wheres = ["kernels.gemv.linear:_gemv_kernel", "kernels.gemv.glu:_gemv_glu_kernel", "kernels.moe_route:_router_kernel",
              "kernels.fp8_gemm:_fp8_gemm_kernel", "kernels.moe_gemv:_down_kernel"]
    code = f"from tests.kernels.test_compiles import ptx_of_first_cases; ptx_of_first_cases({wheres!r})"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ptxs = json.loads(run.stdout.splitlines()[-1])
    assert sorted(ptxs) == sorted(wheres)
    for where, ptx in ptxs.items():
        assert "prefetch.global.L2" in ptx and "griddepcontrol.wait" in ptx, where
        assert ptx.index("prefetch.global.L2") < ptx.index("griddepcontrol.wait"), where
