"""Registers and spills of the GEMV kernels, compiled ahead of time for sm_90a on any machine
(no GPU needed): Triton lowers to PTX, and the ptxas Triton bundles reports what each
variant uses. For choosing rows per program (kernels/gemv/config.py rows_per_program) and
for checking a new config before device time is spent on it.

    python3 benchmarks/ptxas_regs.py            # per-row GEMV and gemv_glu, 1-4 rows per program
    python3 benchmarks/ptxas_regs.py moe        # moe_gemv's two kernels (batch-1 MoE), tile variants
    python3 benchmarks/ptxas_regs.py mla        # latent attention's decode, extend and split merge
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (what the GPU machine compiles with)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.attention.splits import _decode_reduce_kernel  # noqa: E402
from kernels.gemv.glu import _gemv_glu_kernel  # noqa: E402
from kernels.gemv.linear import _gemv_kernel  # noqa: E402
from kernels.mla_decode import _mla_decode_kernel  # noqa: E402
from kernels.mla_extend import _mla_extend_kernel  # noqa: E402
from kernels.moe_gemv import _down_kernel, _gate_up_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def ptxas() -> str:
    found = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas*")))
    if not found:
        raise SystemExit("no ptxas in this Triton install")
    return found[-1]  # (ptxas-blackwell where both are bundled: the newer PTX versions)


def usage(fn, sig: dict, consts: dict, aligned: tuple[str, ...] = (), **opts) -> tuple[int, int]:
    """(registers per thread, bytes of spill stores) of one variant. As a launch specializes them: every
    pointer 16-byte aligned, and the integer arguments named in `aligned` multiples of 16 (a launch
    sees that from their values). Without those facts a GEMM's loads neither vectorize nor pipeline
    through cp.async, and ptxas reports registers and spills the GPU never sees (kernels/fp8_gemm.py at
    64 x 64: 255 registers and 428 bytes of spills unaligned, 78 and none aligned)."""
    kept = set(fn.do_not_specialize_on_alignment) | set(fn.do_not_specialize)  # (the kernel's own opt-outs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if (sig.get(a, "").startswith("*") or a in aligned) and a not in kept}
    sig = {**sig, **{c: "constexpr" for c in consts}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET, options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        out = subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return int(regs[1]) if regs else -1, int(spill[1]) if spill else 0


def gemv(fp8: bool, block_n: int, block_k: int, unroll: int, warps: int, rows: int) -> tuple[int, int]:
    w = "*fp8e4nv" if fp8 else "*bf16"
    s = "*fp32" if fp8 else "*bf16"
    sig = {"x_ptr": w, "w_ptr": w, "out_ptr": "*bf16", "ws_ptr": "*fp32", "sx_ptr": s, "sw_ptr": s, "M": "i32",
           "N": "i32", "K": "i32", "k_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
    consts = dict(BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, EVEN_K=True, SPLIT=False,
                  ACC_1D=False, SCALED=fp8, OUT_DTYPE=tl.bfloat16, INTERP=False, PDL=True)
    return usage(_gemv_kernel, sig, consts, num_warps=warps, num_stages=1)


def glu(fp8: bool, rows: int) -> tuple[int, int]:
    w = "*fp8e4nv" if fp8 else "*bf16"
    s = "*fp32" if fp8 else "*bf16"
    sig = {"x_ptr": w, "w_ptr": w, "out_ptr": "*bf16", "sx_ptr": s, "sw_ptr": s, "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_wn": "i32"}
    consts = dict(BLOCK_M=rows, BLOCK_N=8, BLOCK_K=256, UNROLL=2 if fp8 else 4, EVEN_K=False, SCALED=fp8,
                  OUT_DTYPE=tl.bfloat16, INTERP=False, PDL=True)
    return usage(_gemv_glu_kernel, sig, consts, num_warps=8, num_stages=1)


def cells(f, *args) -> str:
    return "  ".join("{}/{}".format(*f(*args, r)) for r in (1, 2, 3, 4))


def ints(sig: dict) -> tuple[str, ...]:
    """Every integer argument, as aligned: the MoE layers' sizes and strides are multiples of 16."""
    return tuple(a for a, t in sig.items() if t == "i32")


def moe() -> None:
    """moe_gemv at top-8 (Qwen3-30B-A3B): GEMM 1's (rows, columns, unroll) with 4 warps, GEMM 2's
    (rows, columns, unroll, warps); the defaults first; bf16, float8 per row, float8 [128, 128] blocks."""
    print("kernel, config: registers / spill-store bytes")
    for fp8, group in ((False, (1, 0)), (True, (1, 0)), (True, (128, 128))):
        w, kind = ("*fp8e4nv", "fp8" if group[1] == 0 else "fp8 blocks") if fp8 else ("*bf16", "bf16")
        gn, gk = group
        sig = {"x_ptr": w, "w_ptr": w, "ids_ptr": "*i32", "out_ptr": "*bf16", "sx_ptr": "*fp32", "sw_ptr": "*fp32",
               "bias_ptr": "*bf16", "H": "i32", "INTER": "i32", "stride_x": "i32", "stride_we": "i32",
               "stride_wn": "i32", "up_off": "i32", "stride_o": "i32", "stride_se": "i32", "stride_sn": "i32",
               "stride_sx": "i32"}
        for bn, bk, un in [(2, 256, 2), (2, 256, 4), (4, 256, 2), (2, 512, 2), (2, 128, 4)]:
            if gk and bk > gk:  # (moe_gemv cuts a block-scaled chunk to bk, unrolling further)
                bk, un = gk, un * bk // gk
            consts = dict(TOPK=8, BLOCK_N=bn, BLOCK_K=bk, UNROLL=un, GROUP_N=gn, GROUP_K=gk, ACT="silu",
                          ALPHA=1.702, LIMIT=7.0, HAS_BIAS=False, SCALED=fp8, DTYPE=tl.bfloat16, INTERP=False, PDL=True)
            print(f"moe gate_up {kind} {bn}x{bk}x{un}:", "{}/{}".format(*usage(_gate_up_kernel, sig, consts,
                                                                             ints(sig), num_warps=4, num_stages=1)),
                  flush=True)
        sig = {"h_ptr": w, "w_ptr": w, "ids_ptr": "*i32", "weight_ptr": "*fp32", "out_ptr": "*bf16",
               "sh_ptr": "*fp32", "sw_ptr": "*fp32", "bias_ptr": "*bf16", "H": "i32", "INTER": "i32",
               "stride_h": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_o": "i32", "stride_se": "i32",
               "stride_sn": "i32", "stride_sh": "i32"}
        for bn, bk, un, warps in [(4, 128, 2, 8), (4, 128, 4, 8), (2, 128, 2, 4), (4, 256, 1, 8), (8, 64, 2, 8)]:
            if gk and bk > gk:
                bk, un = gk, un * bk // gk
            consts = dict(TOPK=8, TOPK_PAD=8, BLOCK_N=bn, BLOCK_K=bk, UNROLL=un, GROUP_N=gn, GROUP_K=gk,
                          HAS_BIAS=False, SCALED=fp8, DTYPE=tl.bfloat16, INTERP=False, PDL=True)
            print(f"moe down {kind} {bn}x{bk}x{un} w{warps}:", "{}/{}".format(*usage(_down_kernel, sig, consts,
                                                                                  ints(sig), num_warps=warps,
                                                                                  num_stages=1)),
                  flush=True)


def mla() -> None:
    """Latent attention at the released shape (kv_lora_rank 512 + rope 64, page 16, bf16): the
    decode kernel's default (16 heads, 16 keys a block, 4 warps) with and without splits; the
    extend kernel's rows (16 heads x queries) and warps; the split merge at 512 value dims."""
    print("kernel, config: registers / spill-store bytes")
    common = {"cache_ptr": "*bf16", "pt_ptr": "*i32", "seq_lens_ptr": "*i32", "stride_cp": "i32", "stride_cs": "i32",
              "stride_pb": "i32", "H": "i32", "qk_scale": "fp32"}
    sig = {"q_ptr": "*bf16", **common, "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
           "stride_qb": "i32", "stride_qh": "i32", "stride_ob": "i32", "stride_oh": "i32", "num_splits": "i32"}
    for split in (False, True):
        for block_n, stages in ((16, 3), (16, 2), (32, 2)):
            consts = dict(V=512, R=64, PAGE=16, BLOCK_H=16, BLOCK_N=block_n, SPLIT=split, COMPUTE=tl.bfloat16,
                          OUT_DTYPE=tl.bfloat16, PRECISION="tf32", ROPE_DOT=True, INTERP=False, PDL=True)
            print(f"mla decode split={split} n{block_n} s{stages} w4:",
                  "{}/{}".format(*usage(_mla_decode_kernel, sig, consts, num_warps=4, num_stages=stages)), flush=True)
    sig = {"q_ptr": "*bf16", **common, "cu_ptr": "*i32", "tiles_ptr": "*i32", "out_ptr": "*bf16",
           "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32"}
    for tokens, block_n, warps, tiled in ((2, 32, 8, True), (2, 32, 8, False), (2, 16, 8, True), (2, 16, 4, True),
                                          (4, 16, 8, True), (1, 16, 4, True)):
        consts = dict(V=512, R=64, PAGE=16, BLOCK_H=16, BLOCK_T=tokens, BLOCK_N=block_n, TILE_M=64, TILED=tiled,
                      COMPUTE=tl.bfloat16, OUT_DTYPE=tl.bfloat16, PRECISION="tf32", ROPE_DOT=True, INTERP=False,
                      PDL=True)
        print(f"mla extend rows {tokens}x16 n{block_n} w{warps}{' tiles' if tiled else ''}:",
              "{}/{}".format(*usage(_mla_extend_kernel, sig, consts, num_warps=warps, num_stages=2)), flush=True)
    # the GPU tests' shapes: tiny models (4 heads, 32 + 8: the rope's broadcast product) and
    # the kernel tests' float32 (ieee products)
    for dtype, ty in ((tl.bfloat16, "*bf16"), (tl.float32, "*fp32")):
        typed = {**sig, "q_ptr": ty, "cache_ptr": ty, "out_ptr": ty}
        consts = dict(V=32, R=8, PAGE=16, BLOCK_H=4, BLOCK_T=8, BLOCK_N=32, TILE_M=64, TILED=True, COMPUTE=dtype,
                      OUT_DTYPE=dtype, PRECISION="tf32" if dtype == tl.bfloat16 else "ieee", ROPE_DOT=False,
                      INTERP=False, PDL=True)
        print(f"mla extend 32 + 8, 8x4 rows, {ty[1:]}:",
              "{}/{}".format(*usage(_mla_extend_kernel, typed, consts, num_warps=4, num_stages=2)), flush=True)
    dsig = {"q_ptr": "*bf16", **common, "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "stride_qb": "i32", "stride_qh": "i32", "stride_ob": "i32", "stride_oh": "i32", "num_splits": "i32"}
    for dtype, ty in ((tl.bfloat16, "*bf16"), (tl.float32, "*fp32")):
        typed = {**dsig, "q_ptr": ty, "cache_ptr": ty, "out_ptr": ty}
        consts = dict(V=32, R=8, PAGE=16, BLOCK_H=16, BLOCK_N=32, SPLIT=True, COMPUTE=dtype, OUT_DTYPE=dtype,
                      PRECISION="tf32" if dtype == tl.bfloat16 else "ieee", ROPE_DOT=False, INTERP=False, PDL=True)
        print(f"mla decode 32 + 8, split, {ty[1:]}:",
              "{}/{}".format(*usage(_mla_decode_kernel, typed, consts, num_warps=4, num_stages=3)), flush=True)
    sig = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": "*fp32", "out_ptr": "*bf16",
           "stride_ob": "i32", "stride_oh": "i32", "num_splits": "i32"}
    for splits in (8, 64):
        consts = dict(H=16, HEAD_DIM=512, BLOCK_S=splits, BLOCK_D=256, OUT_DTYPE=tl.bfloat16, INTERP=False, PDL=True,
                      HAS_SINKS=False)
        print(f"merge 512 dims, {splits} splits:",
              "{}/{}".format(*usage(_decode_reduce_kernel, sig, consts, num_warps=4)), flush=True)


def main() -> None:
    if sys.argv[1:] == ["moe"]:
        moe()
        return
    if sys.argv[1:] == ["mla"]:
        mla()
        return
    # M = 1's configs (kernels/gemv/config.py gemv_config, glu_config)
    cases = [("bf16 16x256x4 w8", False, 16, 256, 4, 8), ("bf16 4x256x4 w4", False, 4, 256, 4, 4),
             ("fp8 16x256x2 w8", True, 16, 256, 2, 8), ("fp8 16x512x4 w8", True, 16, 512, 4, 8),
             ("fp8 16x512x8 w8", True, 16, 512, 8, 8), ("fp8 16x1024x2 w8", True, 16, 1024, 2, 8)]
    print("kernel, config: registers / spill-store bytes at 1, 2, 3, 4 rows per program")
    for name, fp8, bn, bk, un, warps in cases:
        print(f"gemv {name}:", cells(gemv, fp8, bn, bk, un, warps), flush=True)
    for fp8 in (False, True):
        print(f"gemv_glu {'fp8' if fp8 else 'bf16'} 8x256:", cells(glu, fp8), flush=True)


if __name__ == "__main__":
    main()
