"""Mixtral, Qwen3-MoE and Qwen2-MoE: the Llama decoder whose MLP is a sparse mixture of
experts (Qwen2-MoE's with a gated shared expert beside them).

Routing is transformers' (modeling_mixtral.py, modeling_qwen3_moe.py, 5.24): router logits
in the hidden dtype, softmax in float32, top-k, then the top-k renormalized to sum 1
(Mixtral always, Qwen3-MoE when norm_topk_prob). Qwen3-MoE casts those weights back to
the hidden dtype before the weighted sum; Mixtral keeps them float32. The experts run
through kernels.ops.fused_moe over stacked weights, named as transformers 5.24 names its
modules: mlp.experts.gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows)
and mlp.experts.down_proj [E, H, I], with the router's mlp.gate.weight [E, H].
With quantization "fp8" the experts are float8 (one scale per row of each expert, the
inputs quantized per row: kernels.reference_moe.fused_moe); the router stays in the model's dtype.
A block-scaled float8 checkpoint's experts stay as stored (Experts.block): float8 with one
scale per [bn, bk] block, the inputs quantized per row and group of bk columns.

Checkpoints: save_pretrained of 5.24 still writes one tensor per expert (Mixtral:
block_sparse_moe.experts.N.w1 gate / w3 up / w2 down and block_sparse_moe.gate; Qwen3-MoE:
mlp.experts.N.gate_proj / up_proj / down_proj and mlp.gate). Each is copied straight into
its slice of the stacked parameter; the fused 3-D tensors load too. The missing-tensor
check always names the per-expert tensors.

Qwen3-MoE layers without experts (mlp_only_layers, or (i + 1) % decoder_sparse_step != 0)
keep the dense MLP of intermediate_size. Both classes apply sliding_window to every layer
(windows.UNIFORM_WINDOW).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops
from streamer.errors import ModelLoadError
from streamer.model import quant
from streamer.model.experts import Experts
from streamer.model.layers import MLP, RMSNorm
from streamer.model.llama import LlamaForCausalLM
from streamer.model.tp_group import current as tensor_parallel

FUSED_ACTIVATION = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""Config activation -> kernels.ops.fused_moe's activation."""


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))


class SparseMoE(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, experts: int, top_k: int, renormalize: bool,
        weights_in_hidden_dtype: bool, act: str,
    ) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        if self.tp is not None:  # this rank's share of every expert (model/tp_layers.py)
            intermediate = self.tp.split(intermediate)[1]
        self.gate = Router(hidden, experts)
        self.experts = Experts(hidden, intermediate, experts)
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_hidden_dtype = weights_in_hidden_dtype
        self.activation = FUSED_ACTIVATION[act]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of each token."""
        return ops.route(
            x, self.gate.weight, self.top_k, self.renormalize, x.dtype if self.weights_in_hidden_dtype else None
        )

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether the experts quantize the input per row to float8 (RMSNorm.fp8_rows)."""
        ex = self.experts
        return ex.gate_up_proj_scale is not None and ex.block is None and ex.int4 is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x, *self.route(x))

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(x, residual)) and the new residual: the decoder layer's post-attention
        add + RMSNorm and this block. With the plain router (not a subclass's) and a plain norm, the
        router's kernel does the norm too (ops.norm_route: one launch fewer per layer at decode)."""
        if type(self).route is SparseMoE.route and norm.offset == 0.0:
            args = (x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize,
                    x.dtype if self.weights_in_hidden_dtype else None)
            if norm.fp8_rows:  # (float8 experts: the router's kernel also makes x's float8 rows)
                weights, ids, x, residual, rows = ops.norm_route_fp8(*args)
                quant.attach_rows(x, rows)
            else:
                weights, ids, x, residual = ops.norm_route(*args)
            return self.mix(x, weights, ids), residual
        x, residual = norm(x, residual)
        return self.forward(x), residual

    def mix(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for routed rows x (the block's output)."""
        ex = self.experts
        if ex.int4 is not None:
            assert ex.gate_up_proj_scale is not None and ex.down_proj_scale is not None
            assert ex.gate_up_proj_zero is not None and ex.down_proj_zero is not None
            out = ops.fused_moe_int4(x, (ex.gate_up_proj, ex.gate_up_proj_scale, ex.gate_up_proj_zero),
                                     (ex.down_proj, ex.down_proj_scale, ex.down_proj_zero), ex.int4_groups, weights,
                                     ids, self.activation, ex.int4_perms)
            return out if self.tp is None else self.tp.all_reduce(out)
        out = ops.fused_moe(x, ex.gate_up_proj, ex.down_proj, weights, ids, self.activation,
                            w_gate_up_scale=ex.gate_up_proj_scale, w_down_scale=ex.down_proj_scale, block=ex.block,
                            x_rows=quant.rows_of(x))
        return out if self.tp is None else self.tp.all_reduce(out)


class SharedExpertMoE(SparseMoE):
    """Qwen2-MoE's block: the routed experts plus a shared expert, a dense MLP that every
    token takes, scaled by sigmoid(shared_expert_gate . x) (transformers'
    Qwen2MoeSparseMoeBlock: routed + gate * shared, all in the hidden dtype)."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, renormalize: bool,
                 weights_in_hidden_dtype: bool, act: str, shared_intermediate: int) -> None:
        super().__init__(hidden, intermediate, experts, top_k, renormalize, weights_in_hidden_dtype, act)
        self.shared_expert = MLP(hidden, shared_intermediate, act)  # (its own all-reduce under TP)
        self.shared_expert_gate = Router(hidden, 1)  # (one row: the gate's [1, hidden] weight)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        routed = super().mix(x, weights, ids)
        return routed + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)


class MoEForCausalLM(LlamaForCausalLM):
    """The decoder with SparseMoE layers; subclasses say how the config and checkpoint
    name things."""

    experts_field = "num_experts"
    intermediate_field = "moe_intermediate_size"
    legacy_block = "mlp"
    """The per-expert checkpoint's name of the block (the fused one's is always "mlp")."""
    expert_names = ("gate_proj", "up_proj", "down_proj")
    weights_in_hidden_dtype = True
    shared_expert = False
    """Whether each sparse layer also has a gated shared expert (SharedExpertMoE)."""
    int4_experts = True
    """Whether an int4 checkpoint's per-expert projections load into Experts.expect_int4's layout
    (model/int4_checkpoint.py; False where the experts are stored or computed otherwise)."""

    @property
    def cuda_graphs_ok(self) -> bool:
        """The torch reference of fused_moe synchronizes (torch.unique, .tolist()), which a
        graph capture cannot; graphs need the Triton kernel (kernels/moe.py)."""
        return importlib.util.find_spec("kernels.moe") is not None

    def num_experts(self) -> int:
        return int(getattr(self.config, self.experts_field))

    def expert_intermediate(self) -> int:
        """Each expert's intermediate size (tensor parallelism splits it)."""
        return int(getattr(self.config, self.intermediate_field))

    def shared_intermediate(self) -> int:
        """The shared expert's intermediate size (a dense MLP beside the routed experts)."""
        return int(self.config.shared_expert_intermediate_size)

    def is_sparse(self, i: int) -> bool:
        return True

    def renormalize(self) -> bool:
        return True

    def make_mlp(self, i: int) -> nn.Module | None:
        if not self.is_sparse(i):
            return None
        cfg = self.config
        args = (cfg.hidden_size, self.expert_intermediate(), self.num_experts(), int(cfg.num_experts_per_tok),
                self.renormalize(), self.weights_in_hidden_dtype, self.act)
        if self.shared_expert:
            return SharedExpertMoE(*args, self.shared_intermediate())
        return SparseMoE(*args)

    def _legacy(self, i: int, e: int, which: int) -> str:
        return f"layers.{i}.{self.legacy_block}.experts.{e}.{self.expert_names[which]}.weight"

    def load_expert(self, name: str, tensor: torch.Tensor, what: str) -> set[str] | None:
        m = re.fullmatch(rf"layers\.(\d+)\.(?:mlp|{self.legacy_block})\.(.+)", name)
        if m is None or int(m[1]) >= len(self.layers) or not self.is_sparse(int(m[1])):
            return None
        i, rest = int(m[1]), m[2]
        if rest.startswith("shared_expert"):  # a dense MLP and its gate (SharedExpertMoE): loaded as any
            return None
        block: Any = self.layers[i].mlp
        gate_up, down = block.experts.gate_up_proj.data, block.experts.down_proj.data
        experts = range(self.num_experts())
        inter = gate_up.shape[1] // 2
        if rest.startswith("gate.") and hasattr(block.gate, rest.removeprefix("gate.")):  # the router's
            target, names = getattr(block.gate, rest.removeprefix("gate.")).data, {f"layers.{i}.{self.legacy_block}.{rest}"}
        elif rest == "experts.gate_up_proj":
            target, names = gate_up, {self._legacy(i, e, w) for e in experts for w in (0, 1)}
        elif rest == "experts.down_proj":
            target, names = down, {self._legacy(i, e, 2) for e in experts}
        else:
            int4 = block.experts.int4 is not None
            leaves = "|".join(block.experts.int4_leaves()) if int4 else "weight|weight_scale"
            em = re.fullmatch(rf"experts\.(\d+)\.(\w+)\.({leaves})", rest)
            if em is None or em[2] not in self.expert_names or int(em[1]) >= len(experts):
                raise ModelLoadError(f"{what}: unexpected tensor for {type(self).__name__}")
            e, which = int(em[1]), self.expert_names.index(em[2])
            if int4:
                block.experts.load_int4(e, which, em[3], tensor, what)
                return {self._legacy(i, e, which).removesuffix("weight") + em[3]}
            target = down[e] if which == 2 else gate_up[e].narrow(0, which * inter, inter)
            names = {self._legacy(i, e, which) + ("_scale" if em[3] == "weight_scale" else "")}
            if block.experts.dequantized_block is not None:  # (model/fp8_checkpoint.py says when)
                block.experts.load_block_part(target, self._legacy(i, e, which), em[3], tensor, what)
                return names
            if em[3] == "weight_scale":  # a float8 checkpoint's, per tensor or per channel
                block.experts.load_scale(e, which, tensor, what)
                return names
        if (target.dtype == torch.float8_e4m3fn) != (tensor.dtype == torch.float8_e4m3fn):
            raise ModelLoadError(f"{what} is {tensor.dtype}; the experts of this layer are {target.dtype} "
                                 "(the quantization_config says which layers are float8)")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
        target.copy_(tensor)
        return names

    def expected_weight_names(self) -> set[str]:
        names = super().expected_weight_names()
        for i in range(len(self.layers)):
            if self.is_sparse(i):
                names = {n for n in names if not n.startswith(f"layers.{i}.mlp.") or ".shared_expert" in n}
                names |= {f"layers.{i}.{self.legacy_block}.gate.{p}" for p, _ in self.layers[i].mlp.gate.named_parameters()}
                legacy = {self._legacy(i, e, w) for e in range(self.num_experts()) for w in range(3)}
                names |= legacy
                ex = self.layers[i].mlp.experts
                if ex.int4 is not None:  # an int4 checkpoint's parts, under Int4Linear's names
                    names = (names - legacy) | {n.removesuffix("weight") + leaf for n in legacy
                                                for leaf in ex.int4_leaves()}
                elif ex.gate_up_proj_scale is not None or ex.dequantized_block is not None:  # a float8 checkpoint's
                    names |= {n + "_scale" for n in legacy}
        return names


class MixtralForCausalLM(MoEForCausalLM):
    """Every layer sparse, num_local_experts experts of intermediate_size, the top-k always
    renormalized and kept float32 for the weighted sum. router_jitter_noise only acts in
    training and output_router_logits only adds the logits to the output (transformers'
    MixtralSparseMoeBlock / MixtralForCausalLM): neither changes inference."""

    experts_field = "num_local_experts"
    intermediate_field = "intermediate_size"
    legacy_block = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
    weights_in_hidden_dtype = False

    def attention_biases(self) -> tuple[bool, bool]:
        return False, False


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3's attention (q/k norm, biases from attention_bias); layer i has experts unless
    it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (or num_experts is 0).
    No shared experts (config_check refuses their fields)."""

    qk_norm = True

    def is_sparse(self, i: int) -> bool:
        cfg = self.config
        only = getattr(cfg, "mlp_only_layers", None) or []
        return i not in only and self.num_experts() > 0 and (i + 1) % int(cfg.decoder_sparse_step) == 0

    def renormalize(self) -> bool:
        return bool(self.config.norm_topk_prob)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: Qwen3-MoE's routing (norm_topk_prob, default off) and sparse
    layers (mlp_only_layers, decoder_sparse_step), Qwen2's attention (q/k/v bias from
    qkv_bias, no q/k norm; sliding layers from layer_types), and a shared expert of
    shared_expert_intermediate_size in every sparse layer (SharedExpertMoE)."""

    qk_norm = False
    shared_expert = True

    def attention_biases(self) -> tuple[bool, bool]:
        return bool(getattr(self.config, "qkv_bias", True)), False
