"""float8 (e4m3) weights and activations for the decoder's linear layers (`quantization="fp8"`).

Weights: one scale per output row, max |W[n, :]| / 448, so every row uses the whole e4m3
range. Activations: one scale per token, computed at each call from the token's own
max |x| (dynamic), so no calibration is needed (kernels/quant.py: one Triton kernel on
CUDA, the torch reference elsewhere, the same bits). On CUDA the product goes through
`torch._scaled_mm` (float8 tensor cores on sm_89+), which multiplies both scales back in
while accumulating in fp32 (from 2 to 256 rows, where cuBLAS's tiles would leave SMs idle, a
Triton GEMM of the same formula: kernels/fp8_gemm.py); on CPU the same formula runs as an fp32
matmul:

    y[m, n] = sx[m] * sw[n] * sum_k q(x)[m, k] * q(W)[n, k]

The embedding, the LM head and the norms stay in the model's dtype, as in the usual fp8
checkpoints. On the H200 a linear layer's GEMM is compute-bound at W3's batches (~500
rows), and float8 tensor cores run twice the bf16 FLOPs; its weight stream at batch 1
halves too. At batch 1 (one row, `decode_gemv` on) cuBLAS does not stream the float8
weight well, so `fp8_gemv` / `fp8_gemv_glu` run the Triton GEMV of kernels/gemv.py on the
same quantized operands, with the same formula.

Pre-quantized checkpoints (streamer/model/fp8_checkpoint.py) bring their own scales. A
per-tensor or per-channel weight scale is the per-row scale above (a row vector of one
value, or the checkpoint's rows), and their inputs may be scaled per token (as above) or
per tensor (`act="tensor"`: one scale for every token of the call). Block-scaled weights
(DeepSeek-style, one scale per [bn, bk] tile of W) go through `block_fp8_linear`, with the
inputs scaled per token and per group of bk columns (1 x bk), as those checkpoints expect:

    y[m, n] = sum_j sx[m, j] * sw[n // bn, j] * sum_{k in group j} q(x)[m, k] * q(W)[n, k]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import fp8_gemm, ops
from kernels.gemv import gemv, gemv_glu
from kernels.reference import expand_blocks, quantize_groups_fp8, quantize_rows_fp8

Rows = tuple[torch.Tensor, torch.Tensor]
"""An activation's float8 rows [M, K] and fp32 scales [M, 1] (quantize_rows_fp8's)."""


def attach_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """x with its float8 rows attached (the RMSNorm before a float8 layer makes both in one
    launch: kernels.ops.rms_norm_fp8). A float8 layer per token (fp8_linear, fp8_gemv, the
    per-row float8 experts) that gets this very tensor takes the rows instead of quantizing x
    again; the bits are the same, so results do not depend on whether they came attached.
    Only the tensor object carries them: a view or any op's result has none."""
    x.fp8_rows = rows  # type: ignore[attr-defined]
    return x


def rows_of(x: torch.Tensor) -> Rows | None:
    """The float8 rows attach_rows put on x, or None."""
    return getattr(x, "fp8_rows", None)


def _rows(x2: torch.Tensor, rows: Rows | None) -> Rows:
    """x2 [M, K]'s float8 rows: the attached ones, or quantized now (one Triton kernel on CUDA)."""
    if rows is not None:
        assert rows[0].shape == x2.shape, f"float8 rows of shape {tuple(rows[0].shape)} for x of {tuple(x2.shape)}"
        return rows
    return ops.quantize_rows_fp8(x2)


def fp8_shapes_ok(weight: torch.Tensor) -> bool:
    """cuBLAS's float8 GEMM needs both dimensions of W to be multiples of 16."""
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, act: str = "token") -> torch.Tensor:
    """F.linear with a float8 weight [N, K] (per-row fp32 scales [N]) and the activations
    quantized on the way in, per token (act "token": x's attached rows where it has them) or
    with one scale for the whole call (act "tensor"). x [..., K] -> [..., N] in x.dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if act == "tensor":
        q, sx = quantize_tensor_fp8(x2)
    else:
        q, sx = _rows(x2, rows_of(x))
    if x.is_cuda and fp8_gemm.use_triton(q.shape[0], weight.shape[0], x.device):
        # a few dozen rows: smaller tiles than cuBLAS's, so that every SM has some (kernels/fp8_gemm.py)
        y = fp8_gemm.fp8_gemm(q, sx, weight, weight_scale, x.dtype)
    elif x.is_cuda:
        # cuBLAS's row-wise scaled GEMM writes bf16
        y = torch._scaled_mm(q, weight.t(), scale_a=sx, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)
    else:
        # the same products in fp32 (torch's CPU _scaled_mm, itself an emulation, is missing
        # from older releases and refused these arguments in torch 2.11)
        y = F.linear(q.float() * sx, weight.float() * weight_scale.view(-1, 1))
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def quantize_tensor_fp8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (float8 [M, K], fp32 scales [M, 1] all equal): one scale, max |x| / 448,
    for every row (the per-row scale layout cuBLAS's row-wise GEMM takes)."""
    m, k = x2.shape
    q, s = quantize_rows_fp8(x2.reshape(1, -1))  # torch ops: one row of M * K is no kernel shape
    return q.view(m, k), s.expand(m, 1).contiguous()


def dequantize_blocks(weight: torch.Tensor, block_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 weight a block-scaled float8 one stands for (exact: float8 times an fp32 scale)."""
    rows, cols = weight.shape
    return weight.float() * expand_blocks(block_scale, rows, cols, block)


def cublas_block_scale(block_scale: torch.Tensor) -> torch.Tensor:
    """W's [ceil(N / 128), ceil(K / 128)] scales as torch's 128x128 block-wise GEMM on sm_90
    takes them for mat_b = W.t(): shape [round_up(ceil(K / 128), 4), ceil(N / 128)], strides
    (1, that first size), i.e. the grid padded along K to a multiple of 4 and transposed
    (ATen's ScaledBlas.cpp checks exactly this). Built once at load."""
    nb, kb = block_scale.shape
    padded = block_scale.new_zeros(nb, -(-kb // 4) * 4, dtype=torch.float32)
    padded[:, :kb] = block_scale
    return padded.t()


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None, cublas_scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a block-scaled float8 weight [N, K] (fp32 scales [ceil(N / bn), ceil(K / bk)])
    and the activations quantized per token and per group of bk columns on the way in.

    On CUDA (sm_90, block 128 x 128, `cublas_scale` from cublas_block_scale) one call of torch's
    block-wise scaled GEMM, the weight read as float8. Elsewhere the same products in fp32:
    both operands dequantized at the call (the CPU path is the reference, not a fast path)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    q, sx = quantize_groups_fp8(x2, block[1])
    if x.is_cuda:
        if cublas_scale is None:
            raise RuntimeError("block_fp8_linear on CUDA needs the weight's cublas_block_scale")
        recipe = F.ScalingType
        m = q.shape[0]
        pad = -m % 4
        if pad:
            # cuBLAS's block-wise GEMM refuses (CUBLAS_STATUS_NOT_SUPPORTED) row counts that are
            # not multiples of 4, and torch wants strides (1, 1) at M = 1 (measured on the H200):
            # zero rows, dropped after the product
            q = F.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
            sx = F.pad(sx, (0, 0, 0, pad), value=1.0)
        # the 1 x 128 scales of the input must be outer-dim-major: strides (1, M)
        y = F.scaled_mm(q, weight.t(), sx.t().contiguous().t(), recipe.BlockWise1x128,
                        cublas_scale, recipe.BlockWise128x128, output_dtype=torch.bfloat16)[:m]
    else:
        xq = q.float() * sx.repeat_interleave(block[1], 1)[:, :k]
        y = F.linear(xq, dequantize_blocks(weight, block_scale, block))
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """`fp8_linear` without its bias for a row or a few (x [..., K]) through the GEMV (per_row:
    each row as if alone, see `gemv`)."""
    k = x.shape[-1]
    q, sx = _rows(x.reshape(-1, k), rows_of(x))
    y = gemv(q, weight, scales=(sx, weight_scale), out_dtype=x.dtype, per_row=per_row)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_gemv_glu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(fp8_linear(x, gate_up)) for a row or a few, the activation in the GEMV's epilogue
    (each product rounded to x.dtype first, as the unfused path does)."""
    k = x.shape[-1]
    q, sx = _rows(x.reshape(-1, k), rows_of(x))
    y = gemv_glu(q, weight, scales=(sx, weight_scale), out_dtype=x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0] // 2)


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight the float8 one stands for (tests and the transformers emulation)."""
    return (weight.float() * weight_scale.view(-1, 1)).to(dtype)


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded through float8 token by token, in x's dtype: what `fp8_linear` multiplies
    (the torch reference of the rounding; the Triton kernel gives the same bits)."""
    q, s = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
    return (q.float() * s).to(x.dtype).view(x.shape)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_linear` in plain fp32 arithmetic (products of float8 values are exact in fp32)."""
    y = F.linear(fake_quantize_rows(x).float(), dequantize(weight, weight_scale, torch.float32))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
