"""The layer of an int4 checkpoint (model/int4_checkpoint.py): `Int4Linear`, holding
kernels/int4.py's one layout, and its weight loaders, which repack each format's tensors
into it as they load (the formats as int4_checkpoint's docstring describes them). A loader
gets one part of a fused layer at a time (its rows `start`, `rows` along N): every tensor
of the layout has N as its first dimension, so a part fills a row range of each."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import ops
from streamer.errors import ModelLoadError
from streamer.model.context import rows_as_decode
from streamer.model.layers import Linear

if TYPE_CHECKING:
    from streamer.model.int4_checkpoint import Int4Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's packing: nibble i of a word holds column 8c + AWQ_ORDER[i]."""


class Int4Linear(nn.Module):
    """A linear layer of int4 weights (kernels/int4.py's layout), its inputs and output in the
    model's dtype. `perm` (act order: GPTQ's desc_act, compressed-tensors' actorder "group"):
    the order of K the weights were permuted into, applied to the inputs."""

    decode_gemv = False  # (MLP's fused GEMV + SiLU epilogue reads bf16 or float8 weights only)
    block = None

    def __init__(self, linear: Linear, scheme: Int4Scheme, dev: torch.device) -> None:
        super().__init__()
        n, k = linear.out_features, linear.in_features
        self.in_features, self.out_features = k, n
        self.group = k if scheme.group == -1 else scheme.group
        self.scheme = scheme
        dtype = linear.weight.dtype

        def param(shape: tuple[int, ...], dt: torch.dtype, loader) -> nn.Parameter:
            p = nn.Parameter(torch.zeros(shape, dtype=dt, device=dev), requires_grad=False)
            p.weight_loader = partial(loader, scheme=scheme, k=k, group=self.group)  # type: ignore[attr-defined]
            return p

        self.weight = param((n, k // 8), torch.int32, _load_qweight)
        self.weight_scale = param((n, k // self.group), dtype, _load_scales)
        self.weight_zero: torch.Tensor
        if scheme.zeros:
            self.weight_zero = param((n, k // self.group), torch.uint8, _load_zeros)
        else:
            self.register_buffer("weight_zero", torch.full((n, k // self.group), 8, dtype=torch.uint8, device=dev))
        self.g_idx = param((k,), torch.int32, _load_g_idx) if scheme.g_idx else None
        if self.g_idx is not None:
            self.g_idx.data.fill_(-1)  # (not yet loaded: the first part of a fused layer fills it)
        if scheme.method == "compressed-tensors":
            self.weight_shape = param((2,), torch.int64, _check_shape)
        self.bias = linear.bias
        self.perm: torch.Tensor | None = None

    def permute_rows(self, perm: torch.Tensor) -> None:
        """Output row r becomes the old row perm[r] (Linear.permute_rows: a model's rotary
        reordering of its q/k rows): every tensor of the layout has a row per output, so each
        takes the order (g_idx and perm order K, which stays)."""
        perm = perm.to(self.weight.device)
        for t in (self.weight, self.weight_scale, self.weight_zero, self.bias):
            if t is not None:
                t.data.copy_(t.data[perm].clone())

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] it stands for, in dtype, its columns in the input's order (before or
        after an act order's permutation): a layer that is read as a matrix, not run
        (DeepSeek's kv_b_proj), is dequantized once loaded."""
        q = unpack(self.weight.data)
        k = q.shape[1]
        if self.g_idx is not None and self.perm is None and bool((self.g_idx >= 0).all()):
            g = self.g_idx.data.long()  # (act order not yet applied: each column's own group)
        else:
            g = torch.arange(k, device=q.device) // self.group
        w = ((q - self.weight_zero.to(torch.int32)[:, g]).float() * self.weight_scale.float()[:, g]).to(dtype)
        if self.perm is not None:  # stored column j is input column perm[j]
            w = torch.empty_like(w).index_copy_(1, self.perm.to(w.device), w)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        y = ops.int4_linear(x, self.weight, self.weight_scale, self.weight_zero, self.group, rows_as_decode())
        return y if self.bias is None else y + self.bias


def unpack(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] packed along C -> int32 [R, 8 C], nibble i of word c at column 8c + i
    (or 8c + order[i])."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    if order is not None:
        nib = nib[..., [order.index(j) for j in range(8)]]
    return nib.reshape(packed.shape[0], -1)


def pack(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] of 0..15 -> int32 [R, C / 8] packed along C in order (kernels/int4.py)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (values.to(torch.int64).reshape(values.shape[0], -1, 8) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _expect(tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], what: str) -> None:
    if tensor.dtype not in dtypes:
        raise ModelLoadError(f"{what} is {tensor.dtype}; the quantization_config's int4 format stores "
                             f"{' or '.join(str(d) for d in dtypes)} here")
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)}, the model expects {shape}")


def _load_qweight(param: torch.Tensor, t: torch.Tensor, start: int, rows: int, what: str, *,
                  scheme: Int4Scheme, k: int, group: int) -> None:
    if scheme.method == "awq":
        _expect(t, (k, rows // 8), (torch.int32,), what)
        q = pack(unpack(t, AWQ_ORDER).t())
    elif scheme.method == "gptq":
        _expect(t, (k // 8, rows), (torch.int32,), what)
        q = t.t()  # (packed along K in order: our layout, transposed)
    else:
        _expect(t, (rows, k // 8), (torch.int32,), what)
        q = t
    param.data.narrow(0, start, rows).copy_(q)


def _load_scales(param: torch.Tensor, t: torch.Tensor, start: int, rows: int, what: str, *,
                 scheme: Int4Scheme, k: int, group: int) -> None:
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if scheme.method == "compressed-tensors":
        _expect(t, (rows, k // group), floats, what)
    else:
        _expect(t, (k // group, rows), floats, what)
        t = t.t()
    param.data.narrow(0, start, rows).copy_(t)  # (into the model's dtype: the kernels' operand dtype)


def _load_zeros(param: torch.Tensor, t: torch.Tensor, start: int, rows: int, what: str, *,
                scheme: Int4Scheme, k: int, group: int) -> None:
    if scheme.method == "compressed-tensors":  # packed along N: [ceil(N / 8), groups]
        _expect(t, (-(-rows // 8), k // group), (torch.int32,), what)
        z = unpack(t.t())[:, :rows].t()
    else:
        _expect(t, (k // group, rows // 8), (torch.int32,), what)
        z = unpack(t, AWQ_ORDER if scheme.method == "awq" else None).t() + scheme.zero_offset
    param.data.narrow(0, start, rows).copy_(z)


def _load_g_idx(param: torch.Tensor, t: torch.Tensor, start: int, rows: int, what: str, *,
                scheme: Int4Scheme, k: int, group: int) -> None:
    _expect(t, (k,), (torch.int32, torch.int64), what)
    if bool((param < 0).all()):
        param.data.copy_(t)
    elif not torch.equal(param.data, t.to(param.dtype)):
        raise ModelLoadError(f"{what} differs from the g_idx of the other parts of its fused layer (q/k/v or "
                             "gate/up): their input columns would need different orders")


def _check_shape(param: torch.Tensor, t: torch.Tensor, start: int, rows: int, what: str, *,
                 scheme: Int4Scheme, k: int, group: int) -> None:
    if t.tolist() != [rows, k]:
        raise ModelLoadError(f"{what} is {t.tolist()}, the model's layer is [{rows}, {k}]")
