"""Building blocks of the decoder models. Compute goes through kernels.ops
(Triton on CUDA, the torch reference on CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kernels import ops
from kernels.gemv import gemv, gemv_glu, use_gemv
from streamer.errors import ModelLoadError
from streamer.model import quant
from streamer.model.context import get_context, lora_ids, rows_as_decode
from streamer.model.tp_group import TPGroup
from streamer.model.tp_group import current as tensor_parallel

_deferred = False


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Models built inside have the weights of their linear layers and experts on the meta
    device: no memory until `materialize`. A quantized checkpoint's loader (model/loader.py)
    builds so, replaces the quantized layers' weights with their stored dtype's, then
    allocates the rest: the model never holds a full-precision copy of a quantized layer
    (a 70B int4 or float8 checkpoint would not fit one H200 in bf16 while it loads)."""
    global _deferred
    saved, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = saved


def weight_device() -> str | None:
    """Where a weight is made: "meta" inside deferred_weights, else the default device."""
    return "meta" if _deferred else None


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialized: the checkpoint or dummy values fill them) every parameter
    still on the meta device."""
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(m, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                              requires_grad=p.requires_grad))


class Linear(nn.Linear):
    """nn.Linear that streams its weight through the Triton GEMV for a single row (a decode
    step of batch 1) when `decode_gemv` is on (the runner sets it from EngineConfig), or,
    once `quantize_fp8` has run, multiplies in float8 (streamer/model/quant.py).

    A float8 checkpoint's layer (streamer/model/fp8_checkpoint.py) sets `act` (its inputs'
    scales: "token" or "tensor") or, for block-scaled weights, `block` ([bn, bk]; then
    `weight_scale` is the [ceil(N / bn), ceil(K / bk)] grid)."""

    decode_gemv = False
    act = "token"
    block: tuple[int, int] | None = None
    cublas_scale: torch.Tensor | None = None
    lora: Any = None
    """LoRA adapters of this layer (model/lora.py LoraWeights), added to the output of the rows
    whose step context names one (ForwardContext.lora_ids)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **({**kwargs, "device": "meta"} if _deferred else kwargs))
        self.weight_scale: torch.Tensor | None
        self.register_buffer("weight_scale", None, persistent=False)

    def quantize_fp8(self, split_rows: TPGroup | None = None) -> bool:
        """Replace the weight with its float8 rows and their scales; False (and no change)
        where cuBLAS's float8 GEMM cannot take the shape. split_rows: the group over whose
        ranks each row is split (a row-parallel layer): a row's scale is that of the whole
        row, as with one rank."""
        if not quant.fp8_shapes_ok(self.weight):
            return False
        w = self.weight.data
        row_max = None if split_rows is None else split_rows.all_reduce_max(w.float().abs().amax(-1, keepdim=True))
        q, scale = quant.quantize_rows_fp8(w, row_max)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale.view(-1), persistent=False)
        return True

    def permute_rows(self, perm: torch.Tensor) -> None:
        """Output row r becomes the old row perm[r] (a model's rotary reordering of its q/k
        rows after loading): the weight's rows, the bias, and a float8 checkpoint's per-row
        scales move together; a block scale covers block[0] rows, so a row that would leave
        its block is refused (ModelLoadError)."""
        perm = perm.to(self.weight.device)
        self.weight.data.copy_(self.weight.data[perm].clone())
        if self.bias is not None:
            self.bias.data.copy_(self.bias.data[perm].clone())
        scale = self.weight_scale
        if scale is None:
            return
        if self.block is None:
            if scale.numel() == self.out_features:  # (per row; one per tensor stays as it is)
                scale.view(-1).copy_(scale.view(-1)[perm].clone())
            return
        bn = self.block[0]
        if not torch.equal(perm // bn, torch.arange(len(perm), device=perm.device) // bn):
            raise ModelLoadError(f"a block-scaled float8 checkpoint with [{bn}, {self.block[1]}] blocks cannot take "
                                 "the model's rotary reordering of q/k rows: a row would leave the block its scale "
                                 "covers")

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether this layer quantizes its input per token to float8 (so an RMSNorm before it
        can make the rows: RMSNorm.fp8_rows)."""
        return self.weight_scale is not None and self.block is None and self.act == "token"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        if self.lora is not None and (ids := lora_ids()) is not None:
            y = self.lora.add_delta(y, x, ids)
        return y

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None:
            return quant.block_fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias, self.cublas_scale)
        per_row = rows_as_decode()
        if self.weight_scale is not None:
            # (one row: a per-tensor input scale is its per-token scale)
            if self.decode_gemv and use_gemv(x, self.weight, per_row):
                y = quant.fp8_gemv(x, self.weight, self.weight_scale, per_row)
                return y if self.bias is None else y + self.bias
            return quant.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.act)
        if self.decode_gemv and use_gemv(x, self.weight, per_row):
            y = gemv(x, self.weight, per_row=per_row)
            return y if self.bias is None else y + self.bias
        return super().forward(x)


class RMSNorm(nn.Module):
    """offset 1.0: Gemma's x * (1 + w) (kernels.reference.rms_norm). fp8_rows: the layer after it
    takes float8 rows per token (`takes_fp8_rows`), so the norm's launch also makes them and
    attaches them to its output (quant.attach_rows): one quantization kernel fewer per use."""

    fp8_rows = False

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fp8_rows:
            out, new_res, rows = ops.rms_norm_fp8(x, residual, self.weight, self.eps, self.offset)
            quant.attach_rows(out, rows)
            return out if residual is None else (out, new_res)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, self.offset)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset)


class Attention(nn.Module):
    """window: 0 full attention, else the last `window` tokens; softcap: 0 or Gemma 2's
    score cap; scale: head_dim ** -0.5 unless given (Gemma: query_pre_attn_scalar ** -0.5);
    norm_offset: of the q/k norms (Gemma 3); sinks: a learned sink logit per head (gpt-oss:
    kernels.reference.paged_attention), a float32 parameter whatever the model's dtype (the
    loader keeps it so; the bf16 checkpoint values are exact in it)."""

    def __init__(
        self,
        layer: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        qk_norm_eps: float | None,
        *,
        window: int = 0,
        softcap: float = 0.0,
        scale: float | None = None,
        norm_offset: float = 0.0,
        o_bias: bool = False,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        if self.tp is not None:  # this rank's heads (model/tp_layers.py)
            heads, kv_heads, _, _ = self.tp.heads(heads, kv_heads)
        self.layer = layer
        self.window, self.softcap = window, softcap
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_offset) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_offset) if qk_norm_eps is not None else None
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32))
            self.sinks.float32 = True  # type: ignore[attr-defined]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """q [T, heads, D], k and v [T, kv_heads, D], and the per-head q/k norms that
        rotary_store applies before the rotation (None: none)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:  # (in rotary_store's launch)
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.offset)
        return (q.reshape(t, self.heads, self.head_dim), k.reshape(t, self.kv_heads, self.head_dim),
                v.reshape(t, self.kv_heads, self.head_dim), qk_norm)

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether the input goes to a float8 layer per token (Linear.takes_fp8_rows; an int4
        checkpoint's layers are not Linear)."""
        return isinstance(self.qkv_proj, Linear) and self.qkv_proj.takes_fp8_rows

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        t = x.shape[0]
        q, k, v, qk_norm = self.project(x)
        k_cache, v_cache = ctx.k_cache[self.layer], ctx.v_cache[self.layer]
        q = ops.rotary_store(q, k, v, positions, cos_sin, k_cache, v_cache, ctx.slot_mapping, qk_norm)
        o = ops.paged_attention(
            q, k_cache, v_cache, ctx.page_table, ctx.seq_lens, ctx.cu_q_lens, self.scale, ctx.max_q_len,
            ctx.tiles, ctx.block_m, ctx.num_decodes, window=self.window, softcap=self.softcap,
            split_batch=1 if rows_as_decode() else None, sinks=self.sinks, max_seq_len=ctx.max_seq_len,
        )
        out = self.o_proj(o.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


# transformers' hidden_act / hidden_activation name -> act(gate) * up of [gate | up]
GATED_ACTIVATIONS = {"silu": ops.silu_and_mul, "gelu_pytorch_tanh": ops.gelu_tanh_and_mul}


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False) -> None:
        """bias: on gate, up and down (Llama's mlp_bias; under tensor parallelism the down
        projection's is rank 0's alone, model/tp_layers.py)."""
        super().__init__()
        self.tp = tensor_parallel()
        if self.tp is not None:
            intermediate = self.tp.split(intermediate)[1]
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = act
        self.act_and_mul = GATED_ACTIVATIONS[act]

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether the input goes to a float8 layer per token (Linear.takes_fp8_rows; an int4
        checkpoint's layers are not Linear)."""
        return isinstance(self.gate_up_proj, Linear) and self.gate_up_proj.takes_fp8_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        # (the fused GEMV epilogue is SiLU only and has no bias: GeGLU and biased layers take the
        # gate_up GEMV, then the activation's kernel; block-scaled float8 layers have no GEMV path)
        if (self.act == "silu" and gate_up.decode_gemv and gate_up.block is None and gate_up.bias is None
                and use_gemv(x, gate_up.weight, rows_as_decode()) and lora_ids() is None):
            # one token (or a verify step's rows, each as one): the activation runs in the gate_up
            # GEMV's epilogue (one launch and one round trip through memory fewer per layer)
            if gate_up.weight_scale is not None:
                h = quant.fp8_gemv_glu(x, gate_up.weight, gate_up.weight_scale)
            else:
                h = gemv_glu(x, gate_up.weight)
        elif isinstance(self.down_proj, Linear) and self.down_proj.takes_fp8_rows:
            # (the activation's launch also makes the float8 rows down_proj takes)
            h, rows = ops.act_and_mul_fp8(gate_up(x), gelu=self.act != "silu")
            quant.attach_rows(h, rows)
        else:
            h = self.act_and_mul(gate_up(x))
        out = self.down_proj(h)
        return out if self.tp is None else self.tp.all_reduce(out)
