"""The Llama decoder: Llama 2/3/3.1, SmolLM2, Mistral (a sliding window on every layer).

Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) are the same decoder with
two switches (see qwen.py); Gemma 2/3 (gemma.py) and Phi-3 (phi3.py) override the
hooks (`make_layer`, `embed`, `compute_logits`, `rope_tables`); Mixtral and Qwen3-MoE
(moe.py) swap the MLP through `make_mlp` and `load_expert`. Each layer's window
comes from windows.layer_windows. Weights are stored fused (qkv_proj, gate_up_proj);
load_weights maps transformers' names onto the fused shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from streamer.errors import ModelLoadError
from streamer.model.layers import MLP, Attention, Linear, RMSNorm
from streamer.model.rope import partial_rotary_permutation, rope_cos_sin, rope_params, rotary_dim
from streamer.model.tp_group import current as tensor_parallel
from streamer.model.tp_layers import ParallelLMHead, VocabParallelEmbedding, checkpoint_slice
from streamer.model.windows import layer_windows

# transformers name fragment -> (our fused parameter, shard index)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    def __init__(
        self, attention: Attention, cfg: Any, act: str, mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = attention
        if mlp is None:
            mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act, bias=bool(getattr(cfg, "mlp_bias", False)))
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)

    residual_multiplier = 1.0
    """Scales the attention and MLP outputs before their residual adds (Granite's)."""

    def link_fp8_norms(self) -> None:
        """Each norm makes float8 rows (RMSNorm.fp8_rows) when the block after it takes them
        (`takes_fp8_rows`: float8 layers or experts per token): after a model's quantization."""
        self.input_layernorm.fp8_rows = bool(getattr(self.self_attn, "takes_fp8_rows", False))
        self.post_attention_layernorm.fp8_rows = bool(getattr(self.mlp, "takes_fp8_rows", False))

    def forward(self, positions, x, residual, cos_sin):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        norm_forward = getattr(self.mlp, "norm_forward", None)  # (a mixture of experts: moe.SparseMoE)
        if norm_forward is not None:
            x, residual = norm_forward(x, residual, self.post_attention_layernorm)
        else:
            x, residual = self.post_attention_layernorm(x, residual)
            x = self.mlp(x)
        return (x if self.residual_multiplier == 1.0 else x * self.residual_multiplier), residual


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    partial_rotary = False
    """Whether partial_rotary_factor < 1 is implemented (rope.py; config_check refuses it
    elsewhere, where transformers' class would rotate whole heads)."""
    fused_checkpoint = False
    """Whether checkpoints store qkv_proj and gate_up_proj fused, as this model does (Phi-3),
    rather than as q/k/v and gate/up (STACKED): the quantized checkpoints' names follow."""
    norm_offset = 0.0
    act_field = "hidden_act"
    """The config field naming the MLP's activation (config_check refuses the ones
    layers.GATED_ACTIVATIONS lacks)."""

    def __init__(self, cfg: Any, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.windows = layer_windows(cfg)
        self.act = getattr(cfg, self.act_field, None) or "silu"
        self.tp = tensor_parallel()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.tp is None \
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = self.make_norm()
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.tp is None \
            else ParallelLMHead(cfg.hidden_size, cfg.vocab_size, self.tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        tables, self.layer_rope = self.rope_tables(max_positions)
        for name, table in tables.items():  # (float32; the loader keeps every cos_sin* so)
            self.register_buffer(name, table, persistent=False)

    def make_norm(self) -> nn.Module:
        """The final norm (cohere.py's is a LayerNorm)."""
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, self.norm_offset)

    def attention_biases(self) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): Llama and Qwen3 take both from attention_bias."""
        bias = bool(getattr(self.config, "attention_bias", False))
        return bias, bias

    def attention(self, *args: Any, **kw: Any) -> Attention:
        """Every layer's attention module, from Attention's arguments (olmo.py's normalizes
        whole projections)."""
        return Attention(*args, **kw)

    def make_attention(self, i: int) -> Attention:
        """Layer i's attention as the config says: heads, biases, q/k norms, window."""
        cfg = self.config
        qkv_bias, o_bias = self.attention_biases()
        return self.attention(i, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim,
                              qkv_bias, cfg.rms_norm_eps if self.qk_norm else None, window=self.windows[i],
                              o_bias=o_bias)

    def make_layer(self, i: int) -> nn.Module:
        return DecoderLayer(self.make_attention(i), self.config, self.act, self.make_mlp(i))

    def make_mlp(self, i: int) -> nn.Module | None:
        """Layer i's MLP; None: the dense gated MLP (moe.py returns its sparse block)."""
        return None

    def rope_tables(self, max_positions: int) -> tuple[dict[str, torch.Tensor], list[str]]:
        """(buffer name -> rotary table, each layer's buffer name): one table for all layers."""
        table = rope_cos_sin(self.config, self.head_dim, max_positions)
        return {"cos_sin": table}, ["cos_sin"] * self.config.num_hidden_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    aux_layers: tuple[int, ...] = ()
    """Layers whose inputs (the residual stream there) forward also returns, concatenated in
    aux_hidden, the number of layers standing for the output (after the final norm): the
    features of an EAGLE head (model/eagle_draft.py). Empty: none."""
    aux_hidden: torch.Tensor | None = None
    """[T, len(aux_layers) * hidden] of the last forward (with aux_layers; CUDA graphs set it
    to their static output on replay)."""
    aux_out: torch.Tensor | None = None
    """Where forward writes aux_hidden when it has the rows (the first T): its caller reads it
    before the next forward."""

    @property
    def graph_outputs(self) -> tuple[str, ...]:
        """Attributes forward sets that callers read after it (graphs.keep_outputs)."""
        return ("aux_hidden",) if self.aux_layers else ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed batch (context set by the runner)."""
        x = self.embed(input_ids)
        residual = None
        aux: list[torch.Tensor] = []
        for i, (layer, rope) in enumerate(zip(self.layers, self.layer_rope)):
            for _ in range(self.aux_layers.count(i)):
                aux.append(x if residual is None else x + residual)
            x, residual = layer(positions, x, residual, getattr(self, rope))
        x, _ = self.norm(x, residual)
        for _ in range(self.aux_layers.count(len(self.layers))):
            aux.append(x)
        if aux:
            out = self.aux_out
            t = x.shape[0]
            # (one buffer for every CUDA graph's aux_hidden rather than one each: 0.8 GB for an
            # 8B model's graphs at three depths)
            self.aux_hidden = torch.cat(aux, dim=-1, out=out[:t]) if out is not None and t <= out.shape[0] \
                else torch.cat(aux, dim=-1)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler upcasts only where it computes with them
        (a greedy step's argmax is the same on bf16; the fp32 copy of [batch, vocab] cost
        ~0.1 ms per decode step at batch 512 of a 128k vocabulary)."""
        return self.lm_head(hidden)

    def weight_names(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        """weights: (transformers name, tensor, source file). Every parameter must be filled once."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for hf_name, tensor, source in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if self.tp is not None:  # this rank's slice alone is read (model/tp_layers.py)
                tensor = checkpoint_slice(self.tp, self, name, tensor)
            expert_names = self.load_expert(name, tensor, f"{source}: tensor {hf_name!r}")
            if expert_names is not None:
                filled |= expert_names
                continue
            shard = None
            for frag, (fused, idx) in STACKED.items():
                if f".{frag}." in name:
                    name, shard = name.replace(frag, fused), (frag, idx)
                    break
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"{source}: unexpected tensor {hf_name!r} for {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                # a float8 checkpoint's weight or scale (model/fp8_checkpoint.py): its shard's rows
                rows = (0, self.get_submodule(name.rsplit(".", 1)[0]).out_features) if shard is None \
                    else self._shard_rows(name, shard[1])
                loader(param, tensor, *rows, f"{source}: tensor {hf_name!r}")
                filled.add(hf_name.removeprefix("model."))
                continue
            if shard is None:
                target = param.data
            else:
                target = self._shard(param, name, shard[1])
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            filled.add(hf_name.removeprefix("model."))
        expected = self.expected_weight_names()
        missing = sorted(expected - filled)
        if missing:
            raise ModelLoadError(f"missing tensor(s) in the checkpoint: {', '.join(missing[:5])}")
        self._permute_rotary()

    def fused_module(self, name: str) -> str:
        """The module that checkpoint layer `name` loads into: q/k/v into qkv_proj, gate/up into
        gate_up_proj (STACKED), any other into itself."""
        for frag, (fused, _) in STACKED.items():
            if name.endswith(f".{frag}"):
                return name.removesuffix(frag) + fused
        return name

    def loaded(self) -> None:
        """Once the weights are in (from the checkpoint or dummy values; model/loader.py):
        what the model derives from them (DeepSeek: kv_b_proj's dense matrices)."""

    def skips_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor is none of this model's (transformers ignores it too):
        dropped before anything reads it."""
        return False

    def load_expert(self, name: str, tensor: torch.Tensor, what: str) -> set[str] | None:
        """Copy a mixture-of-experts tensor into its stacked parameter (moe.py) and return
        the checkpoint names it fills; None for any other tensor."""
        return None

    def rotary_permutation(self) -> torch.Tensor | None:
        """New dim -> old dim of a q/k head such that the kernels' rotation of pairs
        (i, i + head_dim/2) is the model's (None: it is already): partial rotary's (rope.py),
        cohere.py's interleaved pairs."""
        rot = rotary_dim(self.config, self.head_dim, rope_params(self.config))
        return partial_rotary_permutation(self.head_dim, rot) if rot < self.head_dim else None

    def _permute_rotary(self) -> None:
        """Reorder each q/k head's rows by rotary_permutation for the whole-head kernels; v and
        o_proj keep theirs (q.k is unchanged by a common permutation)."""
        perm = self.rotary_permutation()
        if perm is None:
            return
        for layer in self.layers:
            attn = layer.self_attn
            order = self.qkv_rows_permutation(attn.qkv_proj)
            assert order is not None
            attn.qkv_proj.permute_rows(order)
            for norm in (attn.q_norm, attn.k_norm):  # per-head q/k norms: their weights follow the dims
                if norm is not None:  # ([head_dim], or [heads, head_dim]: cohere.py's)
                    norm.weight.data.copy_(norm.weight.data[..., perm.to(norm.weight.device)].clone())

    def qkv_rows_permutation(self, qkv: nn.Module) -> torch.Tensor | None:
        """New row -> old row of a qkv_proj under rotary_permutation (each q/k head's rows
        reordered, v's kept), or None where the model does not reorder (LoRA's B rows follow it:
        model/lora.py)."""
        perm = self.rotary_permutation()
        if perm is None:
            return None
        attn = self.layers[0].self_attn
        n_qk, hd = attn.heads + attn.kv_heads, self.head_dim
        heads = (torch.arange(n_qk)[:, None] * hd + perm.cpu()[None, :]).view(-1)  # (v's rows stay)
        return torch.cat([heads, torch.arange(n_qk * hd, qkv.out_features)])

    def part_rows(self, name: str) -> tuple[int, int]:
        """(first row, rows) of checkpoint layer `name` (a q/k/v or gate/up projection) in the
        fused layer it loads into (fused_module)."""
        return self._shard_rows(self.fused_module(name) + ".weight", STACKED[name.rsplit(".", 1)[1]][1])

    def _shard(self, param: nn.Parameter, name: str, idx: int) -> torch.Tensor:
        return param.data.narrow(0, *self._shard_rows(name, idx))

    def _shard_rows(self, name: str, idx: int) -> tuple[int, int]:
        """(first row, rows) of shard idx in the fused layer that parameter `name` belongs to."""
        if "qkv_proj" in name:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.get_submodule(name.rsplit(".", 1)[0]).out_features // 2] * 2
        return sum(sizes[:idx]), sizes[idx]

    def expected_weight_names(self) -> set[str]:
        """Names (without the 'model.' prefix) a complete transformers checkpoint provides."""
        names = set()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if "qkv_proj" in name:
                names |= {name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")}
            elif "gate_up_proj" in name:
                names |= {name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")}
            else:
                names.add(name)
        return names


class MistralForCausalLM(LlamaForCausalLM):
    """The Llama decoder with `sliding_window` on every layer (windows.layer_windows; 0 when
    the config's sliding_window is null) and no biases (config_check refuses attention_bias)."""

    def attention_biases(self) -> tuple[bool, bool]:
        return False, False
