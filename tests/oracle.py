"""transformers as the oracle: greedy generate() in float32, one prompt at a time.

Exact token equality is the rule. The one exception is a genuine near-tie
(the reference's top-2 logits within NEAR_TIE): after it the sequences may
part, and the comparison then follows vLLM's check_logprobs_close: each side's
token must be among the other side's top logprobs at the point they part.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path

import torch

NEAR_TIE = 1e-5
# With float8 K/V (or float8 activations) a last-bit difference of a key or an input
# (another order of float32 operations) can round it to a neighbouring float8 value, 1/16
# apart: continuations may then part at a close call, one whose top-2 logits are within
# this much of each other.
FP8_CLOSE = 0.1


@dataclass
class Reference:
    tokens: list[int]
    top2_gap: list[float]
    top_ids: list[list[int]] = field(default_factory=list)


def _hf_model(path: str, w8a8: bool = False, expert_groups: int = 0):
    """transformers' model of a folder, or of a .gguf file (expert_groups: see
    emulate_block_experts); loaded once per (path, w8a8, expert_groups), however the
    arguments are spelled (`_hf_model(p)` and `_hf_model(p, False, 0)` are one model)."""
    return _load_hf_model(str(path), bool(w8a8), int(expert_groups))


@cache
def _load_hf_model(path: str, w8a8: bool, expert_groups: int):
    from transformers import AutoModelForCausalLM

    # a GGUF file is read by transformers' own GGUF loader: the oracle of a converted file
    where = dict(pretrained_model_name_or_path=str(Path(path).parent), gguf_file=Path(path).name) \
        if path.endswith(".gguf") else dict(pretrained_model_name_or_path=path)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # our runs ignore EOS too: same length on both sides
    if w8a8:
        emulate_w8a8(model)
    if expert_groups:
        emulate_block_experts(model, expert_groups)
    return model


def emulate_block_experts(model: torch.nn.Module, group: int) -> None:
    """transformers computing what block-scaled float8 experts compute, given their
    dequantized weights: the inputs of both of each expert's products rounded through float8
    per row and per group of `group` columns (kernels.reference.quantize_groups_fp8)."""
    from kernels.reference import quantize_groups_fp8

    def rounded(x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_groups_fp8(x, group)
        return (q.float() * s.repeat_interleave(group, 1)[:, : x.shape[1]]).to(x.dtype)

    for m in model.modules():
        if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter) and m.gate_up_proj.dim() == 3:
            m.forward = types.MethodType(partial(_rounded_experts_forward, round_inputs=rounded), m)


def emulate_w8a8(model: torch.nn.Module) -> None:
    """transformers computing what quantization "fp8" computes: every linear layer of the
    decoder (not the LM head) gets its weight rounded through float8 row by row, and its
    input rounded through float8 token by token (streamer/model/quant.py). Per-row and
    per-token scales make this the same whether q/k/v and gate/up are fused or not."""
    from streamer.model.quant import dequantize, fake_quantize_rows, quantize_rows_fp8

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
            q, s = quantize_rows_fp8(m.weight.data)
            m.weight.data = dequantize(q, s.view(-1), m.weight.dtype)
            m.register_forward_pre_hook(lambda mod, args: (fake_quantize_rows(args[0]),))
        elif isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter) and m.gate_up_proj.dim() == 3:
            # a mixture of experts' stacked experts (transformers 5): each expert's rows, and
            # the inputs of both of its products, rounded the same way (the router is not)
            for w in (m.gate_up_proj, m.down_proj):
                e, n, k = w.shape
                q, s = quantize_rows_fp8(w.data.reshape(e * n, k))
                w.data = dequantize(q, s.view(-1), w.dtype).view(e, n, k)
            m.forward = types.MethodType(_rounded_experts_forward, m)


def _rounded_experts_forward(self, hidden_states, top_k_index, top_k_weights, round_inputs=None):
    """transformers' experts loop (Qwen3MoeExperts / MixtralExperts.forward, 5.24) with each
    expert's inputs rounded by round_inputs (default: through float8 row by row)."""
    from streamer.model.quant import fake_quantize_rows

    round_inputs = round_inputs or fake_quantize_rows
    out = torch.zeros_like(hidden_states)
    for e in torch.unique(top_k_index).tolist():
        token_idx, pos = torch.where(top_k_index == e)
        gate, up = torch.nn.functional.linear(round_inputs(hidden_states[token_idx]), self.gate_up_proj[e]).chunk(2, -1)
        h = round_inputs(self.act_fn(gate) * up)
        y = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token_idx, pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


@contextmanager
def fp8_kv_cache() -> Iterator[None]:
    """transformers' cache keeps K/V as float8 e4m3 would (rounded, saturated at +-448): the
    oracle of an engine whose pages are float8 (kv_cache_dtype "fp8", scale 1)."""
    from transformers.cache_utils import DynamicLayer

    update = DynamicLayer.update

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)

    DynamicLayer.update = lambda self, k, v, *a, **kw: update(self, rounded(k), rounded(v), *a, **kw)
    try:
        yield
    finally:
        DynamicLayer.update = update


def hf_greedy(path: str, prompt: tuple[int, ...], max_new: int, kv_fp8: bool = False, w8a8: bool = False,
              expert_groups: int = 0) -> Reference:
    """transformers' greedy continuation of `prompt`, max_new tokens. Computed once per
    (path, prompt, kv_fp8, w8a8, expert_groups), however the arguments are spelled: a
    reference of more tokens serves a shorter request too (greedy decoding without EOS: the
    first n tokens and their logits do not depend on how many follow)."""
    key = (str(path), tuple(prompt), bool(kv_fp8), bool(w8a8), int(expert_groups))
    ref = _REFERENCES.get(key)
    if ref is None or len(ref.tokens) < max_new:
        ref = _REFERENCES[key] = _hf_greedy(*key[:2], max_new, *key[2:])
    return Reference(ref.tokens[:max_new], ref.top2_gap[:max_new], ref.top_ids[:max_new])


_REFERENCES: dict[tuple, Reference] = {}


def _hf_greedy(path: str, prompt: tuple[int, ...], max_new: int, kv_fp8: bool, w8a8: bool,
               expert_groups: int) -> Reference:
    from transformers import GenerationConfig

    model = _hf_model(path, w8a8, expert_groups)
    # No EOS: our runs ignore it too, so both produce exactly max_new tokens.
    config = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad(), fp8_kv_cache() if kv_fp8 else nullcontext():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    gaps, tops = [], []
    for logits in out.logits:
        v, i = logits[0].float().topk(5)
        gaps.append(float(v[0] - v[1]))
        tops.append(i.tolist())
    return Reference(tokens, gaps, tops)


@dataclass
class Comparison:
    exact: int = 0
    near_ties: int = 0
    failures: list[str] = field(default_factory=list)


def compare(path: Path, prompt: list[int], ours: list[int], cmp: Comparison, kv_fp8: bool = False,
            w8a8: bool = False, expert_groups: int = 0) -> None:
    """Record whether `ours` equals transformers' greedy continuation of `prompt` (kv_fp8:
    with its K/V rounded to float8, see fp8_kv_cache; w8a8: its linear layers rounded as
    quantization "fp8" rounds them, see emulate_w8a8; expert_groups: its experts' inputs
    rounded as block-scaled float8 experts round them, see emulate_block_experts)."""
    ref = hf_greedy(str(path), tuple(prompt), len(ours), kv_fp8, w8a8, expert_groups)
    assert len(ours) == len(ref.tokens), f"{len(ours)} tokens, reference has {len(ref.tokens)}"
    for i, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a == b:
            continue
        if ref.top2_gap[i] <= (FP8_CLOSE if kv_fp8 or w8a8 or expert_groups else NEAR_TIE) and a in ref.top_ids[i][:2]:
            cmp.near_ties += 1  # a genuine tie: both continuations are right from here on
            return
        cmp.failures.append(
            f"prompt of {len(prompt)} tokens parts at output {i}: ours {a}, transformers {b} "
            f"(reference top-2 gap {ref.top2_gap[i]:.2e})"
        )
        return
    cmp.exact += 1
