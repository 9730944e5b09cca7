"""float8 (e4m3) weights and activations for the decoder's linear layers (`quantization="fp8"`).

Weights: one scale per output row, max |W[n, :]| / 448, so every row uses the whole e4m3
range. Activations: one scale per token, computed at each call from the token's own
max |x| (dynamic), so no calibration is needed (kernels/quant.py: one Triton kernel on
CUDA, the torch reference elsewhere, the same bits). On CUDA the product goes through
`torch._scaled_mm` (float8 tensor cores on sm_89+), which multiplies both scales back in
while accumulating in fp32; on CPU the same formula runs as an fp32 matmul:

    y[m, n] = sx[m] * sw[n] * sum_k q(x)[m, k] * q(W)[n, k]

The embedding, the LM head and the norms stay in the model's dtype, as in the usual fp8
checkpoints. On the H200 a linear layer's GEMM is compute-bound at W3's batches (~500
rows), and float8 tensor cores run twice the bf16 FLOPs; its weight stream at batch 1
halves too. At batch 1 (one row, `decode_gemv` on) cuBLAS does not stream the float8
weight well, so `fp8_gemv` / `fp8_gemv_glu` run the Triton GEMV of kernels/gemv.py on the
same quantized operands, with the same formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import ops
from kernels.gemv import gemv, gemv_glu
from kernels.reference import quantize_rows_fp8


def fp8_shapes_ok(weight: torch.Tensor) -> bool:
    """cuBLAS's float8 GEMM needs both dimensions of W to be multiples of 16."""
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with a float8 weight [N, K] (per-row fp32 scales [N]) and the activations
    quantized per token on the way in. x [..., K] -> [..., N] in x.dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    q, sx = ops.quantize_rows_fp8(x2)  # one Triton kernel on CUDA
    if x.is_cuda:
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


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """`fp8_linear` without its bias for a row or a few (x [..., K]) through the GEMV."""
    k = x.shape[-1]
    q, sx = ops.quantize_rows_fp8(x.reshape(-1, k))
    y = gemv(q, weight, scales=(sx, weight_scale), out_dtype=x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_gemv_glu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(fp8_linear(x, gate_up)) for one row, the activation in the GEMV's epilogue
    (each product rounded to x.dtype first, as the unfused path does)."""
    k = x.shape[-1]
    q, sx = ops.quantize_rows_fp8(x.reshape(-1, k))
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
