"""The Llama decoder: Llama 2/3/3.1, Mistral-style configs and SmolLM2.

Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) are the same decoder with
two switches (see qwen.py). Weights are stored fused (qkv_proj, gate_up_proj);
load_weights maps transformers' names onto the fused shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from streamer.errors import ModelLoadError
from streamer.model.layers import MLP, Attention, Linear, RMSNorm, rope_cos_sin

# transformers name fragment -> (our fused parameter, shard index)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    def __init__(self, layer: int, cfg: Any, head_dim: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(
            layer,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            qkv_bias,
            eps if qk_norm else None,
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, x, residual, cos_sin):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: Any, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        qkv_bias = self.qkv_bias or bool(getattr(cfg, "attention_bias", False))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(i, cfg, self.head_dim, qkv_bias, self.qk_norm) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", rope_cos_sin(cfg, self.head_dim, max_positions), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed batch (context set by the runner)."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.cos_sin)
        x, _ = self.norm(x, residual)
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
