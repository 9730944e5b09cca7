"""Registers and spills of the W4A16 kernels (kernels/int4.py), compiled ahead of time for
sm_90a with the ptxas Triton bundles (no GPU needed; ptxas_regs.py's `usage`):

    python3 benchmarks/ptxas_int4.py        # the GEMM's and the GEMV's default tiles and neighbours, bf16
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton.language as tl  # noqa: E402
from ptxas_regs import usage  # noqa: E402

from kernels.int4 import _int4_gemm_kernel, _int4_gemv_kernel  # noqa: E402

SIG = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16"}
ALIGNED = ("K", "stride_xm", "stride_wn", "stride_sn", "stride_om")  # (multiples of 16 in every model layer)


def main() -> None:
    print("kernel, config: registers / spill-store bytes")
    sig = {**SIG, "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
           "stride_om": "i32"}
    for bm, bn, bk, warps, stages in ((16, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
                                      (128, 128, 64, 8, 3), (64, 128, 32, 4, 4)):
        consts = dict(G=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DTYPE=tl.bfloat16, PRECISION="tf32", INTERP=False)
        print(f"int4 gemm {bm}x{bn}x{bk} w{warps} s{stages}:",
              "{}/{}".format(*usage(_int4_gemm_kernel, sig, consts, ALIGNED, num_warps=warps, num_stages=stages)), flush=True)
    sig = {**SIG, "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
           "stride_om": "i32"}
    for bn, bk, warps in ((16, 128, 4), (16, 128, 8), (8, 128, 4), (32, 128, 8), (16, 64, 4)):
        consts = dict(G=128, BLOCK_N=bn, BLOCK_K=bk, UNROLL=8, DTYPE=tl.bfloat16, INTERP=False)
        print(f"int4 gemv {bn}x{bk} w{warps}:",
              "{}/{}".format(*usage(_int4_gemv_kernel, sig, consts, ALIGNED, num_warps=warps, num_stages=1)), flush=True)


if __name__ == "__main__":
    main()
