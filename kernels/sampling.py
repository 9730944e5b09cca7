"""One-launch sampling: grammar bitmask, temperature, min-p and the inverse-CDF draw per row.

`draw(logits, words, params)` returns one token per row of logits [N, V]:
- the token's logit is -inf where the row is constrained and its bit in the packed
  xgrammar bitmask `words` [>= N, W] int32 is 0 (bit t % 32 of word t // 32; tokens past
  32 * W are disallowed on constrained rows);
- temperature 0: the argmax (first index of the maximum, as torch.argmax);
- else p_t = exp((l_t - max) / T), zero where p_t < min_p (that is softmax(l / T) below
  min_p times its maximum), and the first token whose running sum of p exceeds
  u * sum(p), for the row's uniform u in [0, 1).

This replaces, on the device, the bitmask kernel, the division, the softmax, the float64
cumsum and the two searchsorted calls of the torch path (streamer/sampling/sampler.py),
and leaves the logits untouched: the host queues one kernel once the masks are in.

One program per row walks the vocabulary once, and then up to the drawn token (once
more before that with min-p): first the maximum, its index and the sum of
exp((l - max) / T), all kept per lane (an online softmax: a lane's sum is rescaled when
its maximum grows) and combined at the end; then the running sums, a block at a time
(tl.cumsum), until the target is passed. Blocks are large (8192 logits, 16 warps): each
iteration costs about one memory latency, so the fewer the faster (2048 took 0.10 ms
for 64 rows of 128k on the H200). The draw
matches kernels.reference.masked_draw except where u * sum falls within float32
rounding of a boundary between two tokens.

params: float64 [4, N] on the device: u, temperature (0 = greedy), min_p, and 1.0 where
the row is constrained by the bitmask (0.0: the row ignores it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192


@triton.jit
def _row_logits(base, wbase, offs, V, W, constrained, HAS_MASK: tl.constexpr):
    """The row's logits at offs (fp32), -inf past V and where the bitmask disallows."""
    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        word = offs // 32
        bits = tl.load(wbase + word, mask=(word < W) & constrained, other=0)
        allowed = (((bits >> (offs % 32)) & 1) != 0) | ~constrained
        x = tl.where(allowed, x, float("-inf"))
    return x


@triton.jit
def _draw_kernel(
    logits_ptr,
    words_ptr,
    params_ptr,
    out_ptr,
    N,
    V,
    W,
    stride_l,
    stride_w,
    HAS_MASK: tl.constexpr,
    MIN_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_l
    wbase = words_ptr + row.to(tl.int64) * stride_w
    u = tl.load(params_ptr + row).to(tl.float32)
    temp = tl.load(params_ptr + N + row).to(tl.float32)
    lanes = tl.arange(0, BLOCK)
    # per lane, so that every mask is a vector (scalar & vector masks upset the interpreter)
    if HAS_MASK:
        flag = (tl.load(params_ptr + 3 * N + row) != 0.0).to(tl.int32)
        constrained = (lanes * 0 + flag) != 0
    else:
        constrained = lanes < 0
    inv_t = 1.0 / tl.maximum(temp, 1e-6)

    # pass 1: per lane, the maximum, its first index and the sum of exp((l - max) / T)
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    sv = tl.zeros([BLOCK], tl.float32)
    iv = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        x = _row_logits(base, wbase, offs, V, W, constrained, HAS_MASK)
        m_new = tl.maximum(mv, x)
        iv = tl.where(x > mv, offs, iv)
        # (a lane with nothing allowed yet subtracts 0, not -inf: -inf - -inf is NaN)
        m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
        sv = sv * tl.exp((mv - m_sub) * inv_t) + tl.exp((x - m_sub) * inv_t)
        mv = m_new
    top = tl.max(mv, axis=0)
    argmax = tl.min(tl.where(mv == top, iv, V), axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # a row with nothing allowed: every p is 0
    total = tl.sum(sv * tl.exp((mv - top) * inv_t), axis=0)

    # min-p: p_t / p_max = exp((l_t - max) / T) must reach min_p; the kept mass is summed again
    floor = 0.0
    if MIN_P:
        floor = tl.load(params_ptr + 2 * N + row).to(tl.float32)
        kept = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            x = _row_logits(base, wbase, start + lanes, V, W, constrained, HAS_MASK)
            p = tl.exp((x - top) * inv_t)
            kept += tl.where(p >= floor, p, 0.0)
        total = tl.sum(kept, axis=0)

    # pass 2: the first token whose running sum exceeds u * total (else the last with mass),
    # stopping at the block that holds it
    target = u * total
    run = 0.0
    hit = V
    last = -1
    start = 0
    while (start < V) & (hit == V):
        offs = start + lanes
        start += BLOCK
        x = _row_logits(base, wbase, offs, V, W, constrained, HAS_MASK)
        p = tl.exp((x - top) * inv_t)
        if MIN_P:
            p = tl.where(p >= floor, p, 0.0)
        cum = tl.cumsum(p, axis=0) + run
        hit = tl.minimum(hit, tl.min(tl.where((cum > target) & (p > 0.0), offs, V), axis=0))
        last = tl.maximum(last, tl.max(tl.where(p > 0.0, offs, -1), axis=0))
        run += tl.sum(p, axis=0)
    drawn = tl.where(hit < V, hit, last)
    drawn = tl.where(drawn >= 0, drawn, argmax)  # nothing allowed at all: any valid id
    tl.store(out_ptr + row, tl.where(temp > 0.0, drawn, argmax).to(tl.int64))


def draw(
    logits: torch.Tensor, words: torch.Tensor | None, params: torch.Tensor, min_p: bool, block: int = BLOCK
) -> torch.Tensor:
    """Tokens int64 [N] for logits [N, V] (any float dtype, unit stride along V).

    words: int32 [>= N, W] bitmask on the logits' device, or None (no row constrained);
    params: float64 [4, N] (see the module docstring); min_p: some row has min_p > 0;
    block: logits per iteration (a power of two; tests use small ones for many blocks).
    """
    n, v = logits.shape
    assert logits.stride(-1) == 1 and params.shape == (4, n) and params.dtype == torch.float64
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if words is not None:
        assert words.dtype == torch.int32 and words.shape[0] >= n and words.stride(-1) == 1
    _draw_kernel[(n,)](
        logits,
        words if words is not None else params,
        params.contiguous(),
        out,
        n,
        v,
        words.shape[1] if words is not None else 0,
        logits.stride(0),
        words.stride(0) if words is not None else 0,
        HAS_MASK=words is not None,
        MIN_P=min_p,
        BLOCK=block,
        num_warps=16 if block >= 8192 else 4,
    )
    return out
