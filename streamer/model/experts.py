"""The stacked expert weights of a mixture of experts (model/moe.py's sparse blocks), named as
transformers 5.24 names them: gate_up_proj [E, 2I, H] (each expert's gate rows, then its up
rows) and down_proj [E, H, I], in the model's dtype, or as a quantized checkpoint or
quantization "fp8" stores them:

- float8 with one scale per row of each expert (`quantize_fp8`, or a float8 checkpoint's
  per-tensor or per-channel scales: `expect_fp8`, `load_scale`);
- float8 with one scale per [bn, bk] block (`expect_fp8` with a block, DeepSeek-style), or such
  a checkpoint dequantized as it loads where the kernels cannot take its blocks
  (`dequantized_block`, `load_block_part`);
- int4 (`expect_int4`, `load_int4`): kernels/moe_int4.py's packed words, each expert's
  projections repacked by model/int4_linear.py's loaders.

MoEForCausalLM.load_expert says which tensor of a checkpoint goes where."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.reference import quantize_rows_fp8
from streamer.errors import ModelLoadError
from streamer.model.int4_linear import (
    _check_shape,
    _load_g_idx,
    _load_qweight,
    _load_scales,
    _load_zeros,
    pack,
    unpack,
)
from streamer.model.layers import weight_device
from streamer.model.quant import dequantize_blocks
from streamer.model.tp_group import TPGroup

if TYPE_CHECKING:
    from streamer.model.int4_checkpoint import Int4Scheme


class Experts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int) -> None:
        super().__init__()
        device = weight_device()  # (meta while a quantized checkpoint's model is built: layers.py)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden, device=device))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate, device=device))
        # float8 experts (quantize_fp8): one fp32 scale per output row of each expert
        self.gate_up_proj_scale: torch.Tensor | None
        self.down_proj_scale: torch.Tensor | None
        self.register_buffer("gate_up_proj_scale", None, persistent=False)
        self.register_buffer("down_proj_scale", None, persistent=False)
        self.block: tuple[int, int] | None = None
        """A block-scaled float8 checkpoint's [bn, bk] (expect_fp8): the experts float8 as stored, their
        scales block grids (kernels.reference_moe.fused_moe's layout: gate_up_proj_scale [E, 2 * ceil(I / bn),
        ceil(H / bk)], the gate's block rows then the up's; down_proj_scale [E, ceil(H / bn), ceil(I / bk)])."""
        self.dequantized_block: tuple[int, int] | None = None
        """A block-scaled float8 checkpoint's [bn, bk] that the kernels cannot take (model/fp8_checkpoint.py
        says which): its experts are dequantized into the model's dtype as they load."""
        self.pending: dict[str, tuple[str, torch.Tensor]] = {}
        """Dequantized block-scaled projections whose weight or scale has come, waiting for the other."""
        self.int4: Int4Scheme | None = None
        """An int4 checkpoint's scheme (expect_int4): gate_up_proj and down_proj hold kernels/moe_int4.py's
        packed words, *_scale its scales (the model's dtype) and *_zero its zeros (uint8)."""
        self.int4_groups = (0, 0)
        """Columns per int4 scale of gate_up_proj and of down_proj (the group size, or a whole row)."""
        self.g_idx: dict[str, torch.Tensor] = {}
        """An act-order int4 checkpoint's g_idx per projection, [E, K], until order_groups."""
        self.int4_perms: tuple[torch.Tensor, torch.Tensor] | None = None
        """Act order (order_groups): each expert's K order of gate_up_proj [E, H] and down_proj [E, I]
        (int32): stored column k of an expert's W is its input's column perm[e, k]."""
        self.gate_up_proj_zero: torch.Tensor | None
        self.down_proj_zero: torch.Tensor | None
        self.register_buffer("gate_up_proj_zero", None, persistent=False)
        self.register_buffer("down_proj_zero", None, persistent=False)

    def expect_fp8(self, device: torch.device, block: tuple[int, int] | None = None) -> None:
        """Empty float8 experts and scales, for a float8 checkpoint to fill (load_expert): one
        scale per row, or with `block` the block grids (Experts.block). The scales start NaN,
        so one the checkpoint lacks cannot pass for a real one."""
        self.block = block
        inter = self.down_proj.shape[2]
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=device),
                                             requires_grad=False))
            shape: tuple[int, ...] = tuple(w.shape[:2])
            if block is not None:
                bn, bk = block
                rows = 2 * -(-inter // bn) if name == "gate_up_proj" else -(-w.shape[1] // bn)
                shape = (w.shape[0], rows, -(-w.shape[2] // bk))
            self.register_buffer(f"{name}_scale", torch.full(shape, float("nan"), device=device),
                                 persistent=False)

    def expect_int4(self, scheme: Int4Scheme, device: torch.device) -> None:
        """Empty int4 experts in kernels/moe_int4.py's layout for an int4 checkpoint to fill
        (MoEForCausalLM.load_expert, each expert's projection repacked by model/int4_linear.py's
        loaders). Scales start NaN, so one the checkpoint lacks cannot pass for a real one; zeros
        start 8 (what a symmetric checkpoint, which stores none, means)."""
        self.int4 = scheme
        dtype = self.down_proj.dtype
        groups = []
        for name in ("gate_up_proj", "down_proj"):
            e, n, k = getattr(self, name).shape
            group = k if scheme.group == -1 else scheme.group
            groups.append(group)
            setattr(self, name, nn.Parameter(torch.zeros((e, n, k // 8), dtype=torch.int32, device=device),
                                             requires_grad=False))
            self.register_buffer(f"{name}_scale", torch.full((e, n, k // group), float("nan"), dtype=dtype,
                                                             device=device), persistent=False)
            self.register_buffer(f"{name}_zero", torch.full((e, n, k // group), 8, dtype=torch.uint8, device=device),
                                 persistent=False)
            if scheme.g_idx:  # (each expert's group of each input column; -1 until loaded: order_groups)
                self.g_idx[name] = torch.full((e, k), -1, dtype=torch.int32, device=device)
        self.int4_groups = (groups[0], groups[1])

    def load_int4(self, e: int, which: int, leaf: str, tensor: torch.Tensor, what: str) -> None:
        """One tensor of expert e's projection `which` (0 gate, 1 up, 2 down) of an int4 checkpoint,
        under Int4Linear's names (model/int4_checkpoint.py renames each format's): repacked into
        its rows of the stacked layout. g_idx waits for order_groups (gate and up must share it)."""
        assert self.int4 is not None
        down = which == 2
        name = "down_proj" if down else "gate_up_proj"
        _, n, k8 = getattr(self, name).shape
        k, group = k8 * 8, self.int4_groups[1 if down else 0]
        rows = n if down else n // 2
        start = 0 if down else which * rows
        kw = {"scheme": self.int4, "k": k, "group": group}
        if leaf == "weight":
            _load_qweight(getattr(self, name)[e], tensor, start, rows, what, **kw)
        elif leaf == "weight_scale":
            _load_scales(getattr(self, f"{name}_scale")[e], tensor, start, rows, what, **kw)
        elif leaf == "weight_zero" and self.int4.zeros:
            _load_zeros(getattr(self, f"{name}_zero")[e], tensor, start, rows, what, **kw)
        elif leaf == "g_idx" and self.int4.g_idx:
            _load_g_idx(self.g_idx[name][e], tensor, 0, k, what, **kw)
        elif leaf == "weight_shape" and self.int4.method == "compressed-tensors":
            _check_shape(tensor, tensor, start, rows, what, **kw)
        else:
            raise ModelLoadError(f"{what}: unexpected tensor for int4 experts ({self.int4.method})")

    def order_groups(self) -> None:
        """After loading an act-order checkpoint: each expert's K permuted so that its groups are
        runs of columns (the scales' order), its perm kept for the kernels to gather the inputs by
        (kernels/moe_int4.py); experts whose g_idx is already k // group keep the identity, and
        where every expert does no perm is kept at all."""
        if not self.g_idx:
            return
        perms = []
        for name, group in zip(("gate_up_proj", "down_proj"), self.int4_groups, strict=True):
            g_all, words = self.g_idx.pop(name), getattr(self, name).data
            k = g_all.shape[1]
            perm = torch.empty_like(g_all)
            for e in range(g_all.shape[0]):
                g = g_all[e].long()
                counts = torch.bincount(g.clamp(0, k // group), minlength=k // group + 1)
                if bool((g < 0).any() or (g >= k // group).any()) or not bool((counts[: k // group] == group).all()):
                    raise ModelLoadError(f"{name} of expert {e}: g_idx is not {k // group} groups of {group} columns "
                                         "each (act order with groups of other sizes is not supported)")
                order = torch.argsort(g, stable=True)
                perm[e] = order.to(torch.int32)
                if not torch.equal(order, torch.arange(k, device=order.device)):
                    words[e] = pack(unpack(words[e])[:, order])
            perms.append(perm)
        identity = all(torch.equal(p, torch.arange(p.shape[1], device=p.device).expand_as(p)) for p in perms)
        self.int4_perms = None if identity else (perms[0], perms[1])

    def int4_leaves(self) -> tuple[str, ...]:
        """The tensors each int4 expert projection loads (under Int4Linear's names)."""
        assert self.int4 is not None
        return ("weight", "weight_scale", *(("weight_zero",) if self.int4.zeros else ()),
                *(("g_idx",) if self.int4.g_idx else ()),
                *(("weight_shape",) if self.int4.method == "compressed-tensors" else ()))

    def quantize_fp8(self, split_rows: TPGroup | None = None) -> None:
        """Each expert's rows to float8 with their scales, as Linear.quantize_fp8 (quantization
        "fp8"); one expert at a time, so the extra memory is one expert's float32 copy.
        split_rows: the tensor-parallel group (down_proj's rows are split over its ranks)."""
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name).data
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            row_max = None
            if split_rows is not None and name == "down_proj":  # (one collective for all experts)
                row_max = torch.stack([w[e].abs().amax(-1, keepdim=True).float() for e in range(w.shape[0])])
                split_rows.all_reduce_max(row_max)
            for e in range(w.shape[0]):
                q[e], s = quantize_rows_fp8(w[e], None if row_max is None else row_max[e])
                scale[e] = s.view(-1)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            self.register_buffer(f"{name}_scale", scale, persistent=False)

    def load_scale(self, e: int, which: int, tensor: torch.Tensor, what: str) -> None:
        """One expert projection's float8 scale: per tensor ([] or [1]) or per output row
        ([rows] or [rows, 1]); either becomes the per-row scales fused_moe multiplies in. With
        Experts.block, the projection's block grid [ceil(rows / bn), ceil(cols / bk)], copied
        as stored (gate's and up's grids each in their own block rows)."""
        scales = self.down_proj_scale if which == 2 else self.gate_up_proj_scale
        if scales is None:
            raise ModelLoadError(f"{what} scales a projection the quantization_config keeps unquantized")
        inter = self.down_proj.shape[2]
        if self.block is not None:
            grid = scales[e] if which == 2 else scales[e].narrow(0, which * (scales.shape[1] // 2), scales.shape[1] // 2)
            if tuple(tensor.shape) != tuple(grid.shape):
                raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)}; the block scales of this projection "
                                     f"([{self.block[0]}, {self.block[1]}] blocks) are {tuple(grid.shape)}")
            grid.copy_(tensor.float())  # (checkpoints store fp32, bf16 or fp16 scales: exact in fp32)
            return
        target = scales[e] if which == 2 else scales[e].narrow(0, which * inter, inter)
        rows = target.shape[0]
        if tuple(tensor.shape) not in {(), (1,), (rows,), (rows, 1)}:
            raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)}; a per-tensor or per-channel scale of "
                                 f"this projection is [] or [{rows}]")
        target.copy_(tensor.float().reshape(-1).expand(rows))

    def load_block_part(self, target: torch.Tensor, name: str, part: str, tensor: torch.Tensor, what: str) -> None:
        """One part (float8 weight or block scales) of a block-scaled expert projection that is
        dequantized at load (dequantized_block); once both are in, the fp32 weight they
        stand for goes into target in the model's dtype."""
        assert self.dequantized_block is not None
        bn, bk = self.dequantized_block
        rows, cols = target.shape
        if part == "weight":
            want, ok = (rows, cols), tensor.dtype == torch.float8_e4m3fn
            if not ok:
                raise ModelLoadError(f"{what} is {tensor.dtype}; the quantization_config makes these experts "
                                     "float8 e4m3")
        else:
            want = (-(-rows // bn), -(-cols // bk))
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)}, the model expects {want}")
        other = self.pending.pop(name, None)
        if other is None or other[0] == part:
            self.pending[name] = (part, tensor)
            return
        weight, scale = (tensor, other[1]) if part == "weight" else (other[1], tensor)
        target.copy_(dequantize_blocks(weight, scale, self.dequantized_block))
