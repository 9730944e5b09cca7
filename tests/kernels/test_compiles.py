"""Kernels compile for the GPU (sm_90a) on a machine without one: Triton's front end and
ptxas run ahead of time. The interpreter (every other CPU test) runs a kernel's Python and
accepts what the compiler refuses, such as a module-level float read inside @triton.jit
(the compiler wants a constexpr): this catches that before device time is spent.

One variant per kernel, each with the constexprs the engine launches it with. The compiler
runs in a child process: this one has TRITON_INTERPRET set (conftest.py), under which
@triton.jit makes interpreted functions that cannot be compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]

NORM = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "new_res_ptr": "*bf16",
        "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_nr": "i32",
        "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
QUANT = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_x": "i32", "live_ptr": "*i32",
         "PAIRS": "i32"}
ALIGN = {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "PAIRS": "i32", "PADDED": "i32",
         "BLOCKS": "i32", "CHUNKS": "i32"}
DEQUANT = {"w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16", "N": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "stride_on": "i32"}

CASES = {
    "rms_norm_fp8": ("kernels.norm:_rms_norm_kernel", NORM, {"N": 2048, "BLOCK": 2048, "HAS_RES": True, "X_DTYPE": tl.bfloat16,
                                              "OUT_DTYPE": tl.bfloat16, "INTERP": False, "PDL": True, "OFFSET": 0.0,
                                              "QUANT": True, "FMAX": 448.0, "TINY": 1e-12}, 8),
    "quantize_live_rows": ("kernels.quant:_quantize_rows_kernel", QUANT, {"K": 768, "BLOCK": 1024, "FMAX": 448.0, "TINY": 1e-12,
                                                          "INTERP": False, "PDL": True, "LIVE_DIV": 1}, 2),
    "align_one_launch": ("kernels.moe_align:_align_small_kernel", ALIGN, {"E": 128, "E_PAD": 128, "BLOCK_M": 16, "CHUNK": 128,
                                                      "FILL": 256, "BB": 16}, 8),
    "int4_dequantize_weight": ("kernels.int4:_dequant_kernel", DEQUANT, {"G": 128, "BLOCK_N": 32, "BLOCK_K": 128,
                                                                        "DTYPE": tl.bfloat16, "INTERP": False}, 4),
}


def compile_case(name: str) -> int:
    """Compile one case (in a process without TRITON_INTERPRET); the cubin's size."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    where, sig, consts, warps = CASES[name]
    module, fn = where.split(":")
    kernel = getattr(importlib.import_module(module), fn)
    src = ASTSource(fn=kernel, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts)
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"])


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; from tests.kernels.test_compiles import CASES, compile_case\n"
            "for name in sorted(CASES):\n"
            "    try:\n"
            "        print(name, compile_case(name))\n"
            "    except Exception as e:\n"
            "        print(name, 'FAILED', type(e).__name__, str(e)[-600:]); sys.exit(1)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(run.stdout.splitlines()) == len(CASES), run.stdout
