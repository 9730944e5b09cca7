"""EAGLE draft heads: speculative_config methods "eagle3" and "eagle" (model/eagle_draft.py).

A head is a decoder layer that reads, besides a token, a *feature* of the target: at a
position i the target computed, a function of the target's hidden states there; at a
position the head itself proposed, the head's own output there. Its input at position i is
(token i + 1, feature i), so it predicts token i + 2. Each head says which of the target's
hidden states it reads (target_layers: the inputs of those layers, the number of layers
meaning the model's output after its final norm) and what it makes of them (target_feature).

EAGLE-3 (Eagle3LlamaForCausalLM: architectures LlamaForCausalLMEagle3 or
Eagle3LlamaForCausalLM, or LlamaForCausalLM as the published heads of Llama targets name
it): the feature is fc(the target's residual streams at three depths, concatenated), and

    e = input_layernorm(embed(token)),  h = hidden_norm(feature)
    x = attention(concat[e, h]) + feature          (q/k/v read 2 * hidden values)
    x = mlp(post_attention_layernorm(x)) + x
    logits = lm_head(norm(x)) over draft_vocab_size tokens, each mapped to the target's
             id (d2t: target id = draft id + d2t[draft id]);  next feature = x

`norm_before_residual` (a config flag) adds the normed feature instead. The checkpoint's
tensors: midlayer.* (the layer), fc.weight [hidden, 3 * target hidden], norm.weight,
lm_head.weight [draft_vocab_size, hidden], d2t (absent when the draft vocabulary is the
target's), t2d (the inverse map: unused), embed_tokens.weight (absent: the target's
embeddings are shared). Which depths: `eagle_config.eagle_aux_hidden_state_layer_ids`, the
layers whose *outputs* are read; without it the inputs of layers 2, N // 2 and N - 3 of an
N-layer target (aux_layers).

EAGLE-1/2 (EagleLlamaForCausalLM: architectures EagleLlamaForCausalLM, or LlamaForCausalLM):
the feature is the target's output (after its final norm), and

    x = fc(concat[embed(token), feature])          (fc.bias where the checkpoint has one;
                                                    HASS heads, add_para_norm: each normed first)
    x = Llama decoder layers over x, the first without its input norm;  x = x + residual
    logits = the target's lm_head(x);  next feature = x

Its tensors: fc.weight [hidden, 2 * hidden] (fc.bias), layers.N.* (no layers.0.input_layernorm),
embedding_layernorm / hidden_states_layernorm (HASS), embed_tokens.weight (absent: shared).

Neither is a model to serve: load_model refuses a head as a target and as a draft_model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from streamer.errors import ModelLoadError
from streamer.model.layers import MLP, Linear, RMSNorm
from streamer.model.llama import LlamaForCausalLM


def aux_layers(head_cfg: Any, target_layers: int, source: str) -> tuple[int, ...]:
    """The target layers whose inputs (residual streams) make the head's features, ascending
    (the order of the concatenation fc was trained on, as the engines that run these heads
    capture them: in layer order). Two conventions name them: eagle_config's
    eagle_aux_hidden_state_layer_ids are layer outputs (SGLang's), a top-level
    eagle_aux_hidden_state_layer_ids layer inputs (vLLM's); a config with both that disagree
    is refused."""
    eagle = getattr(head_cfg, "eagle_config", None) or {}
    nested = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    top = getattr(head_cfg, "eagle_aux_hidden_state_layer_ids", None)
    for key, ids in (("eagle_config.eagle_aux_hidden_state_layer_ids", nested),
                     ("eagle_aux_hidden_state_layer_ids", top)):
        if ids is not None and not (isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) for i in ids)):
            raise ModelLoadError(f"{source}: {key} must list 3 layer indices, not {ids!r}")
    if nested is not None:
        points = [i + 1 for i in nested]  # (a layer's output is the next layer's input)
        if top is not None and sorted(top) != sorted(points):
            raise ModelLoadError(f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids {nested} (layer outputs) "
                                 f"and eagle_aux_hidden_state_layer_ids {top} (layer inputs) name different layers")
    elif top is not None:
        points = list(top)
    else:
        points = [2, target_layers // 2, target_layers - 3]
    if not all(0 <= p < target_layers for p in points):
        raise ModelLoadError(f"{source}: the head reads the target's layers at {sorted(points)} (inputs), but the "
                             f"target has {target_layers} layers: this head is for another model")
    return tuple(sorted(points))


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [normed embedding | normed feature]."""

    def __init__(self, head: Eagle3LlamaForCausalLM) -> None:
        super().__init__()
        cfg = head.config
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = head.make_attention(0)
        attn = self.self_attn
        self.self_attn.qkv_proj = Linear(2 * h, attn.q_size + 2 * attn.kv_size,
                                         bias=bool(getattr(cfg, "attention_bias", False)))
        self.mlp = MLP(h, cfg.intermediate_size, head.act)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, feature: torch.Tensor,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(feature)
        residual = h if self.norm_before_residual else feature
        x = self.self_attn(positions, torch.cat([e, h], dim=-1), cos_sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(LlamaForCausalLM):
    head_method = "eagle3"
    """The speculative_config method it proposes under; load_model refuses it anywhere else."""
    shares_lm_head = False
    """Whether the head computes its logits with the target's LM head (set by the draft)."""

    def __init__(self, cfg: Any, max_positions: int) -> None:
        where = "the EAGLE-3 head's config.json"
        if int(cfg.num_hidden_layers) != 1:
            raise ModelLoadError(f"{where}: num_hidden_layers {cfg.num_hidden_layers}: an EAGLE-3 head has one "
                                 "decoder layer (midlayer; heads of more are not supported)")
        eagle = getattr(cfg, "eagle_config", None) or {}
        if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state", True) is False:
            raise ModelLoadError(f"{where}: eagle_config.use_aux_hidden_state false (a head reading the target's "
                                 "last hidden state alone) is not supported")
        super().__init__(cfg, max_positions)
        self.tie_word_embeddings = False  # (its lm_head is over the draft vocabulary)
        h = cfg.hidden_size
        self.draft_vocab_size = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        self.target_hidden_size = int(getattr(cfg, "target_hidden_size", None) or h)
        self.lm_head = Linear(h, self.draft_vocab_size, bias=False)
        self.fc = Linear(3 * self.target_hidden_size, h, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)
        self.target_ids = torch.arange(self.draft_vocab_size)
        self.maps_vocab = False
        """(loaded: d2t as the target ids of the draft's, and whether that is not the identity)"""
        self.own_embeddings = False
        """Whether the checkpoint had embed_tokens.weight (else the draft shares the target's)."""
        self.feature: torch.Tensor | None = None
        """The input features [T, hidden] of the next forward (set by the caller; a captured
        graph's static buffer of at least T rows)."""
        self.prenorm: torch.Tensor | None = None
        """The last forward's output before the final norm: the features of the next
        positions it proposes for."""

    graph_outputs = ("prenorm",)  # type: ignore[assignment]

    def target_layers(self, target_layers: int, source: str) -> tuple[int, ...]:
        """The target's LlamaForCausalLM.aux_layers for this head."""
        return aux_layers(self.config, target_layers, source)

    def target_feature(self, aux: torch.Tensor) -> torch.Tensor:
        """The feature [T, hidden] of the target's aux_hidden [T, ...] at the same positions."""
        return self.fc(aux)

    def make_layer(self, i: int) -> nn.Module:
        return Eagle3Layer(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The normed output [T, hidden] of tokens at positions with self.feature."""
        assert self.feature is not None, "an EAGLE-3 head reads the features set by its caller"
        # (a CUDA graph's static buffer has rows for its largest batch)
        feature = self.feature[: input_ids.shape[0]]
        x, residual = self.layers[0](positions, self.embed(input_ids), feature, self.cos_sin)
        x, self.prenorm = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: -inf at the tokens the head cannot propose."""
        small = self.lm_head(hidden)
        if not self.maps_vocab:
            return small
        full = small.new_full((small.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.target_ids] = small
        return full

    def expected_weight_names(self) -> set[str]:
        return super().expected_weight_names() - {"embed_tokens.weight"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        d2t_seen = False

        def renamed() -> Iterable[tuple[str, torch.Tensor, str]]:
            nonlocal d2t_seen
            for name, tensor, source in weights:
                if name == "t2d":
                    continue
                if name == "d2t":
                    if tuple(tensor.shape) != (self.draft_vocab_size,):
                        raise ModelLoadError(f"{source}: tensor 'd2t' has shape {tuple(tensor.shape)}, the head's "
                                             f"draft_vocab_size is {self.draft_vocab_size}")
                    self.d2t.copy_(tensor.to(torch.long))
                    d2t_seen = True
                    continue
                if name.removeprefix("model.") == "embed_tokens.weight":
                    self.own_embeddings = True
                if name.removeprefix("model.").startswith("layers."):
                    raise ModelLoadError(f"{source}: tensor {name!r}: an EAGLE-1/2 head (its layer not named "
                                         "midlayer), which runs with speculative_config method 'eagle'")
                yield name.replace("midlayer.", "layers.0."), tensor, source

        super().load_weights(renamed())
        if self.draft_vocab_size != self.config.vocab_size and not d2t_seen:
            raise ModelLoadError(f"the EAGLE-3 head proposes among {self.draft_vocab_size} of {self.config.vocab_size} "
                                 "tokens but has no 'd2t' tensor mapping them to the target's ids")
        ids = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size or ids.unique().numel() != ids.numel():
            raise ModelLoadError("the EAGLE-3 head's 'd2t' maps its tokens outside the target's vocabulary or two "
                                 "onto one")

    def loaded(self) -> None:
        self.target_ids = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        self.maps_vocab = self.draft_vocab_size != self.config.vocab_size or bool(self.d2t.any())


class EagleLlamaForCausalLM(LlamaForCausalLM):
    head_method = "eagle"
    shares_lm_head = True
    graph_outputs = ("prenorm",)  # type: ignore[assignment]

    def __init__(self, cfg: Any, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        h = cfg.hidden_size
        self.target_hidden_size = h
        self.layers[0].input_layernorm = nn.Identity()  # (the first layer's input is fc's output as it is)
        # (bias or not is the checkpoint's: an absent fc.bias stays zero, see load_weights)
        self.fc = Linear(2 * h, h, bias=True)
        self.para_norm = bool(getattr(cfg, "add_para_norm", False))
        if self.para_norm:  # HASS
            self.embedding_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_states_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        del self.norm, self.lm_head  # (no final norm; the logits are the target's LM head's)
        self.lm_head: nn.Module | None = None
        self.own_embeddings = False
        self.fc_bias = False
        self.feature: torch.Tensor | None = None
        self.prenorm: torch.Tensor | None = None

    def target_layers(self, target_layers: int, source: str) -> tuple[int, ...]:
        return (target_layers,)  # (the output, after the final norm)

    def target_feature(self, aux: torch.Tensor) -> torch.Tensor:
        return aux

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The output [T, hidden] of tokens at positions with self.feature (also prenorm: the
        next positions' feature)."""
        assert self.feature is not None, "an EAGLE head reads the features set by its caller"
        e, h = self.embed(input_ids), self.feature[: input_ids.shape[0]]
        if self.para_norm:
            e, h = self.embedding_layernorm(e), self.hidden_states_layernorm(h)
        x, residual = self.fc(torch.cat([e, h], dim=-1)), None
        for layer, rope in zip(self.layers, self.layer_rope):
            x, residual = layer(positions, x, residual, getattr(self, rope))
        self.prenorm = x + residual
        return self.prenorm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "the draft gives an EAGLE head the target's LM head"
        return self.lm_head(hidden)

    def expected_weight_names(self) -> set[str]:
        return {n for n in super().expected_weight_names() if n not in ("embed_tokens.weight", "fc.bias")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        def renamed() -> Iterable[tuple[str, torch.Tensor, str]]:
            for name, tensor, source in weights:
                if name.startswith("midlayer."):
                    raise ModelLoadError(f"{source}: tensor {name!r}: an EAGLE-3 head, which runs with "
                                         "speculative_config method 'eagle3'")
                if name.removeprefix("model.") == "embed_tokens.weight":
                    self.own_embeddings = True
                if name == "fc.bias":
                    self.fc_bias = True
                if name.removeprefix("model.") == "lm_head.weight":
                    raise ModelLoadError(f"{source}: tensor 'lm_head.weight': an EAGLE-1/2 head computes its logits "
                                         "with its target's LM head, not one of its own")
                yield name, tensor, source

        super().load_weights(renamed())

    def loaded(self) -> None:
        if not self.fc_bias:
            assert self.fc.bias is not None
            self.fc.bias.data.zero_()
