"""Tiny random EAGLE heads saved as their checkpoints are (EAGLE-3: config.json +
midlayer.*, fc, norm, lm_head, d2t, t2d; EAGLE-1/2: fc (and its bias), layers.0.* without
the input norm), and an independent reference of what a head proposes: transformers' target
for the features, the head's formulas in plain torch with no KV cache (every step
recomputes every position)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 96
"""Every test head's attention and MLP shapes."""


def _shapes(target: Path, seed: int, std: float
            ) -> tuple[dict, int, int, Callable[..., torch.Tensor], torch.Generator]:
    """The target's config, hidden size and vocabulary, a draw of random weights (std), and
    its generator."""
    tcfg = json.loads((target / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    return tcfg, tcfg["hidden_size"], tcfg["vocab_size"], w, g


def make_head(folder: Path, target: Path, *, draft_vocab: int, layer_ids: list[int] | None, seed: int = 0,
              embeddings: bool = False, std: float = 0.2, pickle: bool = False,
              architecture: str = "LlamaForCausalLMEagle3") -> Path:
    """A one-layer head for the target folder's model, with random weights (std), proposing
    among draft_vocab tokens (a random subset of the target's, d2t) unless it equals the
    target's vocabulary; pickle: saved as pytorch_model.bin (as most published heads are)."""
    from safetensors.torch import save_file

    tcfg, h, vocab, w, g = _shapes(target, seed, std)

    t = {
        "midlayer.input_layernorm.weight": 1 + w(h) / 2,
        "midlayer.hidden_norm.weight": 1 + w(h) / 2,
        "midlayer.post_attention_layernorm.weight": 1 + w(h) / 2,
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": w(INTER, h),
        "midlayer.mlp.up_proj.weight": w(INTER, h),
        "midlayer.mlp.down_proj.weight": w(h, INTER),
        "fc.weight": w(h, 3 * h),
        "norm.weight": 1 + w(h) / 2,
        "lm_head.weight": w(draft_vocab, h),
    }
    if draft_vocab != vocab:
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    if embeddings:
        t["embed_tokens.weight"] = w(vocab, h)
    cfg = {
        "architectures": [architecture], "model_type": "llama", "hidden_size": h,
        "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "max_position_embeddings": tcfg["max_position_embeddings"], "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if pickle:
        torch.save(t, str(folder / "pytorch_model.bin"))
    else:
        save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    return folder


def head_tensors(head: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (head / "pytorch_model.bin").is_file():
        return torch.load(str(head / "pytorch_model.bin"), weights_only=True)
    return load_file(str(head / "model.safetensors"))


def agreeing_pair(root: Path) -> tuple[Path, Path]:
    """A 4-layer target whose LM head is zero, so that it always picks token 0 (the argmax of
    equal logits), and a head over its whole vocabulary with a zero LM head, which always
    proposes token 0: every proposal is kept."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import make_tiny_model

    target = make_tiny_model(root / "target", "LlamaForCausalLM", None, num_hidden_layers=4)
    head = make_head(root / "agree", target, draft_vocab=49152, layer_ids=None, embeddings=True)
    for f in (target / "model.safetensors", head / "model.safetensors"):
        t = load_file(str(f))
        t["lm_head.weight"].zero_()
        save_file(t, str(f))
    return target, head


def make_eagle1_head(folder: Path, target: Path, *, seed: int = 0, fc_bias: bool = True, std: float = 0.2,
                     architecture: str = "LlamaForCausalLM") -> Path:
    """A one-layer EAGLE-1/2 head for the target folder's model (pickled, as published)."""
    tcfg, h, vocab, w, g = _shapes(target, seed, std)

    t = {
        "fc.weight": w(h, 2 * h),
        "layers.0.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, h),
        "layers.0.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, h),
        "layers.0.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, h),
        "layers.0.self_attn.o_proj.weight": w(h, HEADS * HEAD_DIM),
        "layers.0.post_attention_layernorm.weight": 1 + w(h) / 2,
        "layers.0.mlp.gate_proj.weight": w(INTER, h),
        "layers.0.mlp.up_proj.weight": w(INTER, h),
        "layers.0.mlp.down_proj.weight": w(h, INTER),
    }
    if fc_bias:
        t["fc.bias"] = w(h)
    cfg = {
        "architectures": [architecture], "model_type": "llama", "hidden_size": h, "intermediate_size": INTER,
        "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": vocab, "max_position_embeddings": tcfg["max_position_embeddings"], "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "bias": fc_bias,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(t, str(folder / "pytorch_model.bin"))
    return folder


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotation of halves: x [T, heads, D] at positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _attention(t: dict[str, torch.Tensor], p: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """Causal GQA self-attention of layer prefix p over x [L, in] at positions 0..L-1."""
    n, heads, kvh, hd = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    pos = torch.arange(n)
    q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).view(n, heads, hd), pos, cfg["rope_theta"])
    k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).view(n, kvh, hd), pos, cfg["rope_theta"])
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, kvh, hd)
    k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return o.transpose(0, 1).reshape(n, HEADS * HEAD_DIM) @ t[p + "self_attn.o_proj.weight"].T


def _mlp(t: dict[str, torch.Tensor], p: str, y: torch.Tensor) -> torch.Tensor:
    return (F.silu(y @ t[p + "mlp.gate_proj.weight"].T) * (y @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T


def eagle1_forward(t: dict[str, torch.Tensor], cfg: dict, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The EAGLE-1/2 head's output [L, H] (its logits' input and its next feature)."""
    x = torch.cat([embeds, feats], -1) @ t["fc.weight"].T
    if "fc.bias" in t:
        x = x + t["fc.bias"]
    p = "layers.0."
    resid = _attention(t, p, cfg, x) + x
    return _mlp(t, p, _rms(resid, t[p + "post_attention_layernorm.weight"])) + resid


def head_forward(t: dict[str, torch.Tensor], cfg: dict, embeds: torch.Tensor, feats: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, prenorm) [L, H] of the EAGLE-3 head over positions 0..L-1, causal, no cache."""
    p = "midlayer."
    x = torch.cat([_rms(embeds, t[p + "input_layernorm.weight"]), _rms(feats, t[p + "hidden_norm.weight"])], -1)
    resid = _attention(t, p, cfg, x) + feats
    pre = _mlp(t, p, _rms(resid, t[p + "post_attention_layernorm.weight"])) + resid
    return _rms(pre, t["norm.weight"]), pre


def reference_eagle1_proposals(target, head: Path, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """reference_proposals of an EAGLE-1/2 head: its features are the target's output (after
    the final norm), its logits the target's LM head's."""
    t = head_tensors(head)
    cfg = json.loads((head / "config.json").read_text())
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        feats = hs[-1][0]
        embed = t["embed_tokens.weight"] if "embed_tokens.weight" in t else target.get_input_embeddings().weight
        lm_head = target.get_output_embeddings().weight
        toks = list(tokens[1:])
        out, gaps = [], []
        for _ in range(k):
            y = eagle1_forward(t, cfg, embed[torch.tensor(toks)], feats)
            logits = y[-1] @ lm_head.T
            top = logits.topk(2).values
            gaps.append(float(top[0] - top[1]))
            out.append(int(logits.argmax()))
            toks.append(out[-1])
            feats = torch.cat([feats, y[-1:]])
    return out, gaps


def reference_proposals(target, head: Path, tokens: list[int], k: int, points: list[int]
                        ) -> tuple[list[int], list[float]]:
    """What the head proposes after tokens (the last at the verify chunk's start), greedily:
    k tokens, and the gap between the top two logits of each (near-ties)."""
    t = head_tensors(head)
    cfg = json.loads((head / "config.json").read_text())
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[p][0] for p in points], -1) @ t["fc.weight"].T
        embed = t["embed_tokens.weight"] if "embed_tokens.weight" in t else target.get_input_embeddings().weight
        ids = torch.arange(cfg["draft_vocab_size"]) + t.get("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        toks = list(tokens[1:])
        out, gaps = [], []
        for _ in range(k):
            normed, pre = head_forward(t, cfg, embed[torch.tensor(toks)], feats)
            logits = normed[-1] @ t["lm_head.weight"].T
            top = logits.topk(2).values
            gaps.append(float(top[0] - top[1]))
            d = int(ids[int(logits.argmax())])
            out.append(d)
            toks.append(d)
            feats = torch.cat([feats, pre[-1:]])
    return out, gaps
