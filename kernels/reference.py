"""Plain torch versions of every kernel (the mixture of experts': kernels/reference_moe.py).

These are the CPU path of the engine (what CI runs) and the oracle the Triton
kernels are tested against. They follow transformers' arithmetic order so that
float32 greedy decoding matches `generate()` token for token.

Shapes used throughout:
  T  packed tokens of a batch (no padding), B sequences, H query heads,
  KVH key/value heads, D head dim, P pages, S page size.
  A page table row lists the pages of one sequence in order; a slot is
  `page * S + offset` and addresses one token's K/V inside a layer's cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """offset 0 (Llama): weight * normed rounded to x.dtype first. offset != 0 (Gemma, 1.0):
    normed * (offset + weight) all in float32, rounded to x.dtype once, as transformers'
    Gemma RMSNorm (the stored weight is the deviation from 1; adding 1 to a bf16 weight
    would round it)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (offset + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps, offset), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up -> gelu_tanh(gate) * up, [T, I] (GeGLU of Gemma:
    transformers' "gelu_pytorch_tanh")."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
"""gpt-oss's clamped SwiGLU parameters (transformers' GptOssExperts: alpha, config.swiglu_limit)."""


def swigluoai_and_mul(
    x: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT
) -> torch.Tensor:
    """x: [T, 2I] holding gate then up -> gpt-oss's clamped SwiGLU, [T, I] (transformers'
    GptOssExperts._apply_gate, on the de-interleaved layout): gate clamped to <= limit, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), torch ops in x.dtype."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


MOE_ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")
"""The activations of fused_moe (and of the Triton MoE kernels)."""


FP8_MAX = 448.0
FP8_TINY = 1e-12  # the scale of an all-zero row: any positive value keeps it zero


def quantize_rows_fp8(x: torch.Tensor, row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 e4m3 [M, K], fp32 scales [M, 1]) with x ~ q * scale, row by row:
    scale = max |x[m, :]| / 448, so each row uses the whole e4m3 range. row_max [M, 1]: the
    rows' max |x| where x holds slices of longer rows (the max over every slice)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if row_max is None else row_max.float()
    scale = (amax / FP8_MAX).clamp_min(FP8_TINY)
    # multiplied by the reciprocal (one division per row, as the kernel); the product can
    # land a hair past 448 (fp32 rounding): saturate rather than get NaN
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_groups_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], fp32 scales [M, ceil(K / group)]): each row's columns
    quantized in groups of `group` (block-scaled float8's inputs, 1 x bk), every group with its
    own max |x| / 448 (the last group may be shorter): quantize_rows_fp8 of each group."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k))  # zeros change no max
    q, scale = quantize_rows_fp8(padded.view(m * groups, group))
    q = q.view(m, groups * group)
    if groups * group != k:
        q = q[:, :k].contiguous()
    return q, scale.view(m, groups)


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A [ceil(rows / bn), ceil(cols / bk)] grid of scales as one value per element [rows, cols]."""
    bn, bk = block
    return scale.float().repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as Llama/Qwen in transformers.

    q: [T, H, D], k: [T, KVH, D], positions: [T] int, cos_sin: [max_pos, D]
    float32 holding cos(freqs) in the first D/2 columns and sin(freqs) in the
    last D/2 (already multiplied by the rope attention scaling).
    """
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1).unsqueeze(1)
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1).unsqueeze(1)
    dtype = q.dtype
    cos, sin = cos.to(dtype), sin.to(dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, KVH, D] into k_cache, v_cache [P, S, KVH, D] at slots [T].

    A slot of -1 is skipped (padding of captured CUDA graphs).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size  # indexing: any cache strides
    for x, cache in ((k, k_cache), (v, v_cache)):
        rows = x[keep]
        if cache.element_size() == 1:  # float8: saturated at +-448 like the kernel (some torch
            # versions cast larger values to NaN); index_put_ has no float8 kernel on CPU
            rows = rows.float().clamp(-448.0, 448.0).to(cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        else:
            rows = rows.to(cache.dtype)
        cache[pages, offsets] = rows


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence whose page table row is `pages`."""
    s = cache.shape[1]
    n = (length + s - 1) // s
    return cache[pages[:n].long()].flatten(0, 1)[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over K/V held in pages.

    q: [T, H, D]; k_cache, v_cache: [P, S, KVH, D]; page_table: [B, max_pages];
    seq_lens: [B] context length of each sequence including its new tokens;
    cu_q_lens: [B+1] offsets of each sequence's queries in q. The i-th query of
    sequence b sits at position seq_lens[b] - q_len_b + i and sees keys at
    positions up to and including its own. Returns [T, H, D].

    window > 0 (sliding-window attention, as transformers masks it): a query at position
    i sees the keys at positions j with i - window < j <= i, the last `window` tokens.
    softcap > 0 (Gemma 2): each score s = scale * q.k becomes softcap * tanh(s / softcap)
    before the softmax.
    sinks (gpt-oss's attention sinks): float32 [H], one logit per query head in natural-log
    units, not scaled nor capped, that joins every row's softmax with a zero value vector:
    out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sinks[h])). Computed in float32, as with
    softcap.

    With a window, only the pages from the one holding the lowest key any of the call's
    queries sees are read: the page-table entries before it may be stale (the scheduler
    releases pages wholly outside the window; they may since hold anything, NaN included).
    """
    out = torch.empty_like(q)
    h = q.shape[1]
    page_size, kvh = k_cache.shape[1:3]
    lens = seq_lens.tolist()
    starts = cu_q_lens.tolist()
    for b, length in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        ql = q1 - q0
        # keys from k0, the first position of the page of the first query's lowest visible key
        k0 = max(0, length - ql - window + 1) // page_size * page_size if window > 0 else 0
        pages = page_table[b, k0 // page_size :]
        k = gather_kv(k_cache, pages, length - k0).to(q.dtype)
        v = gather_kv(v_cache, pages, length - k0).to(q.dtype)
        mask = None
        if ql > 1 or window > 0:
            qpos = torch.arange(length - ql, length, device=q.device)[:, None]
            kpos = torch.arange(k0, length, device=q.device)[None, :]
            mask = kpos <= qpos
            if window > 0:
                mask &= kpos > qpos - window
        if softcap > 0 or sinks is not None:
            if kvh != h:
                k = k.repeat_interleave(h // kvh, dim=1)
                v = v.repeat_interleave(h // kvh, dim=1)
            qb, kb, vb = q[q0:q1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            scores = (qb.float() @ kb.float().transpose(1, 2)) * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                # as transformers' GptOss: the sink is one more logit of each row's softmax,
                # whose probability is then dropped (its value vector is zero)
                sink = sinks.float()[:, None, None].expand(h, ql, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            o = (probs @ vb.float()).to(q.dtype)
            out[q0:q1] = o.transpose(0, 1)
        elif q.dtype != torch.float32:
            # bf16 / fp16: the unfused math over K and V repeated per query head. (torch's CPU
            # flash kernel below is less exact at these dtypes: 5% off float32 where this is
            # 0.3%, with float8 V at +-448, tests/kernels/test_kv_fp8.py)
            if kvh != h:
                k = k.repeat_interleave(h // kvh, dim=1)
                v = v.repeat_interleave(h // kvh, dim=1)
            o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=scale)
            out[q0:q1] = o.transpose(0, 1)
        else:
            # float32 (the CPU engine's dtype): 4-D and grouped (K and V read as stored, not
            # repeated per query head), which torch's CPU flash kernel takes, masked or causal;
            # 3-D operands would run the unfused math (a 1,000-token prefill of SmolLM2 on 2
            # cores: 12 against 57 ms a layer). A prefill with no cached prefix is plain causal.
            causal = mask is not None and window == 0 and ql == length
            o = F.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=None if causal else mask, is_causal=causal, scale=scale, enable_gqa=kvh != h,
            )
            out[q0:q1] = o[0].transpose(0, 1)
    return out


def masked_draw(logits: torch.Tensor, words: torch.Tensor | None, params: torch.Tensor) -> torch.Tensor:
    """kernels.sampling.draw in torch (params float64 [4, N]: u, temperature, min_p, constrained)."""
    n, v = logits.shape
    u, temp, min_p, constrained = params.cpu().to(logits.device)
    x = logits.float().clone()
    if words is not None:
        t = torch.arange(v, device=x.device)
        w = t // 32
        bits = (words[:n, w.clamp(max=words.shape[1] - 1)] >> (t % 32)) & 1
        allowed = (bits != 0) & (w < words.shape[1])
        x = torch.where(allowed | (constrained[:, None] == 0), x, float("-inf"))
    greedy = x.argmax(-1)
    top = x.amax(-1, keepdim=True)
    p = ((x - top) / temp.clamp(min=1e-6).float()[:, None]).exp()
    p = torch.where(p >= min_p.float()[:, None], p, 0.0)
    cdf = p.double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    j = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    drawn = torch.minimum(j, last).clamp_(max=v - 1).squeeze(1)
    return torch.where(temp > 0, drawn, greedy)
