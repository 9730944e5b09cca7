"""Triton GEMV for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 4 (a few tokens).

Why not cuBLAS: at M = 1..4 a linear layer is a pure stream of W, and cuBLAS
picks GEMM tilings that leave most of the H200's bandwidth unused on mid-size
weights (1.8 TB/s on 4096x4096 where a copy reaches 4.25 TB/s). Decode time is
the sum of these streams, so each layer should read W once, as fast as the
memory allows.

Layout of the work: one program owns BLOCK_N rows of W (row-major [N, K], an
nn.Linear weight) and walks K in BLOCK_K chunks, loads coalesced along K.
All M rows of x are handled in the same program (one fp32 accumulator per row),
so W is read exactly once whatever M. The accumulators are [BLOCK_N, BLOCK_K]
tiles (elementwise FMAs, no tl.dot: at M <= 4 tensor cores buy nothing and the
interpreter gets bf16 dots wrong) reduced along K once at the end; UNROLL
chunks are loaded per iteration so more bytes are in flight per warp without
growing the accumulators.

When N / BLOCK_N programs are too few to keep every SM streaming (small N * K,
e.g. Qwen3-0.6B's o and down projections, N = 1024), K is split over a second grid axis: each split writes
fp32 partial sums to a workspace and a tiny second kernel adds the splits in a
fixed order, so results are deterministic (no atomics) and CUDA-graph safe.

Configs are fixed per (M, N, K) by `gemv_config` (no autotuning at run time: the
engine captures CUDA graphs, and benchmarking inside a capture is not
possible); `streamer bench gemv` sweeps alternatives to tune it.

`gemv_glu` fuses SwiGLU into the gate_up projection at M = 1: each program
streams gate rows and the up rows that pair with them and applies silu(gate) *
up in its epilogue, which saves the silu_and_mul launch and its round trip. (The
activation fused into the down projection's x loads instead was slower on the
H200, 38.0 against 30.1 us: every program recomputed the activations of its K
range; it was removed.)

On sm_90 the kernels are launched with programmatic dependent launch (see
kernels.common.pdl_enabled). Prefetching the first 1,024 columns of each
program's W rows into L2 before the PDL wait was slower: W2 went from 4.17 to
4.34 ms/token (2,048 columns: 4.44), the prefetches competing with the previous
kernel for the bandwidth; it was removed.

Rows past N or M are clamped to the last valid row for loads (no masks in the
hot loop) and masked at the store; K is masked only when a split's range is not
a multiple of BLOCK_K * UNROLL. Under TRITON_INTERPRET (CPU tensors, tests)
bf16 roundings are done by hand because the interpreter truncates casts.

Modules: `linear` (gemv: the kernel, its split-K reduction and launch), `glu` (gemv_glu),
`config` (when the GEMV replaces F.linear, `use_gemv`, and the launch parameters of each
shape, `gemv_config` and `glu_config`).
"""

from kernels.gemv.config import (
           MAX_M,
           GemvConfig,
           gemv_config,
           glu_config,
           num_sms,
           rows_per_program,
           use_gemv,
)
from kernels.gemv.glu import gemv_glu
from kernels.gemv.linear import gemv

__all__ = ["MAX_M", "GemvConfig", "gemv", "gemv_config", "gemv_glu", "glu_config", "num_sms", "rows_per_program",
           "use_gemv"]
