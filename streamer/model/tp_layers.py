"""What tensor parallelism changes in the decoder (Megatron's split, as vLLM and SGLang do):

  q/k/v, gate/up   column-parallel: each rank holds the output rows of its heads (its share
                   of the intermediate size); no communication.
  o, down          row-parallel: each rank holds the input columns matching the above and
                   produces a partial sum; one all-reduce (the layers call TPGroup.all_reduce);
                   a bias is held by rank 0 alone (zeros elsewhere), so it is added once.
  experts          each expert's gate/up column-parallel and down row-parallel over its
                   intermediate size (the router is whole on every rank); one all-reduce
                   of the combined output.
  embedding        vocab-parallel: each rank holds ceil(vocab / size) rows; a token outside
                   its rows embeds to zeros there; one all-reduce.
  LM head          vocab-parallel rows (the embedding's, when tied); the logits are
                   all-gathered, so every rank holds the whole row. Rank 0 samples alone and
                   broadcasts the tokens (runner.py): the sampler's state (generators,
                   grammar masks, penalties) then lives in one place, and the other ranks
                   need only the token ids that the next step may read on the device.

Each rank reads only its slices of the checkpoint (checkpoint_slice, on safetensors'
lazy slices): no rank holds a whole copy of a sharded weight. A fused checkpoint tensor
(Phi-3's qkv_proj and gate_up_proj) is read as its parts' slices, concatenated.

A model whose attention projections are not head_dim per head (multi-head latent attention,
model/deepseek.py) names them in `tp_head_sizes`: projection -> rows per head (o_proj: its
columns per head), split by this rank's heads; its tensors that no rule names (the latent's
projections and norms) are read whole.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from streamer.model.layers import Linear
from streamer.model.tp_group import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.first, self.rows, _ = group.vocab(vocab)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        inside = (local >= 0) & (local < self.rows)
        x = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        x = x * inside.unsqueeze(-1).to(x.dtype)
        return self.group.all_reduce(x)


class ParallelLMHead(Linear):
    """The LM head over this rank's vocabulary rows; returns the whole [.., vocab] logits."""

    def __init__(self, hidden: int, vocab: int, group: TPGroup) -> None:
        _, rows, _ = group.vocab(vocab)
        super().__init__(hidden, rows, bias=False)
        self.group, self.vocab = group, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        if local.shape[0] == 0:  # (every rank has the same batch: all skip the collective)
            return local.new_zeros(0, self.vocab)
        return self.group.all_gather_last(local)[..., : self.vocab]


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)


def _take(t: Any, dim: int, first: int, n: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [first, first + n) of a tensor or a safetensors slice:
    only those bytes are read."""
    return t[first : first + n] if dim == 0 else t[:, first : first + n]


_EXPERT = re.compile(r"\.experts\.(?:\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$")
"""A mixture of experts' tensors: per expert (Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down
projections) or stacked over the experts (transformers' fused experts)."""


def checkpoint_slice(group: TPGroup, model: Any, name: str, t: Any) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` (transformers' name without "model."),
    of the shape of its parameter here. `t`: a tensor or a safetensors slice."""
    cfg = model.config
    hd = model.head_dim
    q, kv, q0, kv0 = group.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
    quantized = _quantized_slice(group, model, name, t)
    if quantized is not None:
        return quantized
    expert = _EXPERT.search(name)
    if expert is not None:  # a mixture of experts: every expert's intermediate size is split
        inter = model.expert_intermediate()
        first, n = group.split(inter)
        one, stacked = expert[1], expert[2]
        if one in ("w1", "w3", "gate_proj", "up_proj"):  # one expert's [I, H]
            return _take(t, 0, first, n)
        if one is not None:  # w2, down_proj: one expert's [H, I]
            return _take(t, 1, first, n)
        if stacked == "gate_up_proj":  # [E, gate | up, H]
            return torch.cat([t[:, first : first + n], t[:, inter + first : inter + first + n]], dim=1)
        return t[:, :, first : first + n]  # down_proj [E, H, I]
    if ".self_attn.qkv_proj." in name:  # a fused checkpoint tensor (Phi-3): [q | k | v] rows
        q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        return torch.cat([_take(t, 0, q0 * hd, q * hd), _take(t, 0, q_rows + kv0 * hd, kv * hd),
                          _take(t, 0, q_rows + kv_rows + kv0 * hd, kv * hd)])
    if ".mlp.gate_up_proj." in name:  # [gate | up] rows (Phi-3)
        first, n = group.split(cfg.intermediate_size)
        return torch.cat([_take(t, 0, first, n), _take(t, 0, cfg.intermediate_size + first, n)])
    if name.endswith((".self_attn.q_norm.weight", ".self_attn.k_norm.weight")) and len(_shape(t)) == 2:
        # a weight per head (Command R+'s [heads, head_dim]): this rank's heads
        return _take(t, 0, q0, q) if ".q_norm." in name else _take(t, 0, kv0, kv)
    module, _, leaf = name.rpartition(".")
    split = linear_split(group, model, module)
    if split is not None:  # a split linear layer: its weight's rows or columns, a bias with its rows
        axis, first, n = split
        if axis == 1 and leaf == "bias":  # (a row-parallel layer's bias: rank 0's alone)
            whole = t[:]
            return whole if group.rank == 0 else torch.zeros_like(whole)
        return _take(t, axis, first, n)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        first, rows, held = group.vocab(_shape(t)[0])
        part = _take(t, 0, first, held)
        if held < rows:  # the last shard's padding rows: zero logits, never looked up
            part = torch.cat([part, part.new_zeros(rows - held, *part.shape[1:])])
        return part
    return t[:]


def linear_split(group: TPGroup, model: Any, module: str) -> tuple[int, int, int] | None:
    """(axis, first, count) of this rank's part of the weight [N, K] of the linear layer named
    `module` in the checkpoint: axis 0 (output rows: column-parallel) or 1 (input columns:
    row-parallel); None where every rank holds it whole."""
    cfg = model.config
    hd = model.head_dim
    q, kv, q0, kv0 = group.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
    proj = re.search(r"\.self_attn\.(\w+)$", module)
    sizes: dict[str, int] = getattr(model, "tp_head_sizes", {})
    if proj is not None and proj[1] in sizes:
        return (1 if proj[1] == "o_proj" else 0, q0 * sizes[proj[1]], q * sizes[proj[1]])
    if proj is not None and proj[1] == "q_proj":
        return 0, q0 * hd, q * hd
    if proj is not None and proj[1] in ("k_proj", "v_proj"):
        return 0, kv0 * hd, kv * hd
    if proj is not None and proj[1] == "o_proj":
        return 1, q0 * hd, q * hd
    expert = _EXPERT_LAYER.search(module)
    if expert is not None:  # one expert's projection: split over the expert intermediate size
        first, n = group.split(model.expert_intermediate())
        return (1 if expert[1] in ("w2", "down_proj") else 0, first, n)
    mlp = re.search(r"\.mlp\.(shared_experts?\.)?(gate_proj|up_proj|down_proj)$", module)
    if mlp is None:
        return None
    first, n = group.split(model.shared_intermediate() if mlp[1] else cfg.intermediate_size)
    return (1 if mlp[2] == "down_proj" else 0, first, n)


def _quantized_slice(group: TPGroup, model: Any, name: str, t: Any) -> torch.Tensor | None:
    """This rank's part of a tensor of a float8 or int4 checkpoint's layer (its scales, packed
    weights, zeros, group indices: each in its format's layout, model/fp8_checkpoint.py and
    model/int4_checkpoint.py), or None for any other tensor (a float8 weight is [N, K] like any
    weight: the plain rules take it). A part that would start inside a block, a packed word or a
    group is refused by name."""
    from streamer.errors import ModelLoadError
    from streamer.model.int4_linear import Int4Linear

    module, _, leaf = name.rpartition(".")
    split = linear_split(group, model, module)
    if split is None or leaf == "bias":  # (a bias is a bias whatever the weight's format: the plain rules)
        return None
    axis, first, count = split
    layer = _layer(model, module)
    # an int4 layer, or a block's experts of an int4 checkpoint (model/experts.py: int4 experts are
    # split as these layers are, gate/up by rows and down by columns)
    scheme = layer.scheme if isinstance(layer, Int4Linear) else getattr(layer, "int4", None)
    int4 = scheme is not None
    if layer is None or int4:
        block = None
    elif _EXPERT_LAYER.search(module) is not None:  # (the layer: the Experts of the block, moe.py)
        block = layer.block or layer.dequantized_block
    elif layer.weight.dtype == torch.float8_e4m3fn:
        block = layer.block
    else:
        return None
    if not int4 and (layer is None or leaf != "weight_scale"):
        return None

    def unit(size: int, what: str) -> tuple[int, int]:
        if first % size or (count % size and first + count != _whole(model, module, axis)):
            raise ModelLoadError(f"tensor parallelism: this rank's {count} {'rows' if axis == 0 else 'columns'} "
                                 f"of {module} from {first} do not fall on whole {what} of {size}")
        return first // size, -(-count // size)

    if not int4:  # a float8 layer's scale: one per tensor, per row, or per [bn, bk] block
        shape = _shape(t)
        if block is not None:
            b0, bn = unit(block[axis], "weight blocks")
            return _take(t, axis, b0, bn)
        if len(shape) == 0 or shape[0] == 1 or axis == 1:
            return t[:]  # (per tensor, or per row of a row-parallel layer: every rank's rows)
        return _take(t, 0, first, count)
    method, g = scheme.method, scheme.group
    n_major = method == "compressed-tensors"  # ([N, ...] tensors; AWQ's and GPTQ's are [K..., N...])
    dim = (0 if n_major else 1) if axis == 0 else (1 if n_major else 0)
    if leaf == "weight_shape":
        n, k = t[:].tolist()
        return torch.tensor([count, k] if axis == 0 else [n, count], dtype=torch.int64)
    if leaf == "g_idx":
        if axis == 0:
            return t[:]
        if g == -1:
            raise ModelLoadError(f"tensor parallelism: {name} with one group per row")
        g0, gn = unit(g, "groups")
        idx = t[first : first + count]
        if bool(((idx < g0) | (idx >= g0 + gn)).any()):
            raise ModelLoadError(f"tensor parallelism: {module}'s act order (g_idx) puts columns of this rank's "
                                 f"part in other ranks' groups: act-order int4 row-parallel layers cannot be split")
        return idx - g0
    if axis == 0:  # output rows: packed 8 to a word along N in AWQ's qweight and every format's zeros
        packed = leaf == "weight_zero" or (leaf == "weight" and method == "awq")
        return _take(t, dim, *unit(8, "packed words")) if packed else _take(t, dim, first, count)
    if leaf == "weight":  # input columns: packed along K in GPTQ's and compressed-tensors' weights
        return _take(t, dim, first, count) if method == "awq" else _take(t, dim, *unit(8, "packed words"))
    if g == -1:
        return t[:]  # (one scale and zero per row: every rank's columns share them)
    return _take(t, dim, *unit(g, "groups"))


_EXPERT_LAYER = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")


def _layer(model: Any, module: str) -> Any:
    """The model's linear layer that checkpoint layer `module` loads into (q/k/v into qkv_proj,
    gate/up into gate_up_proj; one expert's projection: its block's Experts), or None."""
    if _EXPERT_LAYER.search(module) is not None:
        i = re.search(r"layers\.(\d+)\.", module)
        return None if i is None else getattr(model.layers[int(i[1])].mlp, "experts", None)
    try:
        return model.get_submodule(model.fused_module(module))
    except AttributeError:
        return None


def _whole(model: Any, module: str, axis: int) -> int:
    """The checkpoint layer's whole size along axis (0: N, 1: K): where the last rank's part
    ends."""
    cfg = model.config
    proj = re.search(r"\.self_attn\.(\w+)$", module)
    sizes: dict[str, int] = getattr(model, "tp_head_sizes", {})
    if proj is not None:
        per = sizes.get(proj[1], model.head_dim)
        heads = cfg.num_key_value_heads if proj[1] in ("k_proj", "v_proj") else cfg.num_attention_heads
        return heads * per
    if _EXPERT_LAYER.search(module) is not None:
        return int(model.expert_intermediate())
    return int(model.shared_intermediate() if ".shared_expert" in module else cfg.intermediate_size)
