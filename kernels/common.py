"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float8_e4m3fn: tl.float8e4nv,  # KV caches only (kv_cache_dtype "fp8")
}


PDL = True
"""Programmatic dependent launch where the GPU has it. This package does not read the
engine's settings (it does not import streamer): the engine sets this from its config
(STREAMER_PDL=0 turns it off, streamer.config.use_pdl) before it captures its graphs."""


def sm_count(device: torch.device | int) -> int:
    """The SM count of a CUDA device, by index or torch.device (without an index: the current
    one), asked once per device (split and grid heuristics, at every eager launch)."""
    if isinstance(device, torch.device):
        device = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(device)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pdl_enabled(x: torch.Tensor) -> bool:
    """Launch the kernels reading `x` with programmatic dependent launch (PDL)?

    On sm_90+ a kernel launched with PDL may start (its programs become resident, run
    their prologue) while the kernel before it in the stream finishes; `pdl_enter` makes
    it wait for that kernel's completion before touching memory that kernel may produce
    or read. A decode step at batch 1 is a chain of ~300 short kernels, each of which
    otherwise pays its launch and ramp-up in full. Off where `PDL` is False."""
    if not PDL or not x.is_cuda or interpreting():
        return False
    return _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """In a kernel launched with `launch_pdl=PDL`: wait until the kernel before it has completed
    and its writes are visible, then let the next kernel launch. Without PDL it is nothing.
    Every program passes here before any store and before any load of what the kernel just
    before it writes. Loads of what no kernel of the step writes (weights, the step's inputs)
    may come first, and so may loads of what kernels further back wrote: this kernel launches
    only once every program of the one before passed its own wait, i.e. after those completed.
    Every program must pass here: a grid whose programs all skipped the wait could complete
    before its predecessor and release its successor early."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


DEFAULT_PREFETCH_BYTES = 2048
PREFETCH_BYTES = DEFAULT_PREFETCH_BYTES
"""Bytes of each of its weight rows a GEMV program asks L2 for before its PDL wait (`prefetch_l2`):
the first chunks it will load. A GEMV of a decode step follows a short, latency-bound kernel (a norm,
attention's merge, a split-K reduce) during which the memory bus idles; its resident programs wait
there for that kernel, and their first weight bytes can be on their way meanwhile. 0: none (the
engine sets it from its config, STREAMER_L2_PREFETCH, streamer.config.use_l2_prefetch)."""


def prefetch_lines(row_bytes: int, pdl: bool) -> int:
    """LINES for `prefetch_l2`: 128-byte lines of each weight row (of `row_bytes` in the program's
    share) to prefetch, a power of two; 0 without PDL, where a kernel starts after the one before
    it has ended and its own loads begin at once."""
    if not pdl or row_bytes <= 0 or PREFETCH_BYTES <= 0:
        return 0
    return max(1, min(PREFETCH_BYTES, triton.next_power_of_2(row_bytes)) // 128)


@triton.jit
def prefetch_l2(row_ptrs, row_len, LINES: tl.constexpr):
    """Ask L2 for the first LINES 128-byte lines of the rows starting at `row_ptrs` ([R] pointers of
    any element type, 16-byte aligned rows of `row_len` elements; lines past a row's end are not
    asked for). A hint: nothing waits for it and no register holds the data. Called before
    `pdl_enter` with weights only (which no kernel of the step writes): the loads after the wait
    then find them in L2."""
    if LINES > 0:
        PER_LINE: tl.constexpr = 128 // (row_ptrs.dtype.element_ty.primitive_bitwidth // 8)
        offs = tl.minimum(tl.arange(0, LINES) * PER_LINE, row_len - 1)
        ptrs = row_ptrs[:, None] + offs[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )


def log_compiles(log) -> bool:
    """Log every kernel variant Triton builds (or loads from its disk cache) from now on: its
    name and argument specialization (STREAMER_LOG_COMPILES=1, diagnostics). A variant built
    after the warm-up stalls a step for ~1 s of compilation the first time it is needed.
    False where this Triton has no such hook."""
    import time

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False

    def hook(*, key: object, fn: object, **_: object) -> bool:
        log.warning("triton variant at %.3f: %s %s", time.perf_counter(), getattr(fn, "name", fn), key)
        return False  # (compile as usual)

    runtime.jit_cache_hook = hook
    return True


def interpreting() -> bool:
    """True under TRITON_INTERPRET (numpy emulation, used for CPU tensors in the tests).

    Read here, not through streamer.config: it is Triton's own switch (triton.jit reads it
    when a kernel is decorated), not the engine's, and this must agree with Triton's reading
    of it whoever imports the kernels (the tests and benchmarks call them directly)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """fp32 `x` rounded (nearest even) to DTYPE, returned as DTYPE.

    The interpreter truncates bf16 casts, so it rounds by hand there. float8 e4m3
    saturates at +-448 (a cast beyond it gives NaN) and is always rounded by hand."""
    if DTYPE == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        # round here (nearest even) to 3 mantissa bits, or to the 2^-9 grid below 2^-6, so
        # that the cast below is exact: the interpreter loses the carry when rounding up
        # reaches the next power of two (7.84 -> 4.0), and a compiled fp32 -> fp8 cast may
        # round twice (through fp16); this way every path stores torch's rounding
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        mag = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) / 512.0  # 1.5 * 2^23: nearest even
        # x's sign bit on the magnitude (a compiled -mag is 0 - mag: +0.0 where torch keeps -0.0)
        sub = (mag.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    if INTERP and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
