"""kernels.moe.fused_moe == kernels.reference_moe.fused_moe (issue 30), and the alignment's
invariants.

Without a GPU these run through the Triton interpreter on tiny shapes (H, I not multiples
of the blocks; small explicit tiles so the loops run several K chunks and N blocks).

Tolerances: float32 differs from the reference by summation order only. In bf16 both
round every stage (gate/up, activation, product, down) to bf16 but sum in another
order, so an intermediate may differ by one bf16 ulp (2^-8 relative) and that carries
through the down projection: 2^-6 relative/absolute on outputs of order 1. On CPU both
multiply the same bf16 values with float32 sums, so the bf16 outputs agree bit for bit nearly
everywhere (all of them at these seeds); requiring that (<= 2% of the elements differ)
checks that every stage is rounded where the reference rounds it (leaving out the
activation's rounding changes about half the elements by an ulp, within the tolerance).
"""

from __future__ import annotations

import pytest
import torch

from kernels import moe as M
from kernels import reference_moe as RM
from kernels.moe_align import align_pairs
from tests.kernels.device import CUDA, DEVICE, cuda

TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
ACTS = pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
SMALL = M.MoeConfig(block_m=16, block_n=16, block_k=16)


def _problem(t, h, i, e, k, dtype, seed, experts_used=None):
    """Random x, weights and a top-k routing over `experts_used` (default: all E)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=gen) * h**-0.5).to(dtype)
    w_down = (torch.randn(e, h, i, generator=gen) * i**-0.5).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    if experts_used is not None:
        unused = torch.ones(e, dtype=torch.bool)
        unused[experts_used] = False
        logits[:, unused] = float("-inf")
    top, ids = logits.topk(k, dim=-1)
    weights = top.softmax(-1)
    return [a.to(DEVICE) for a in (x, w_gate_up, w_down, weights, ids)]


def assert_like_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A kernel's MoE output against the reference's: within TOL, and in bf16 on the CPU (the
    interpreter rounds as the reference does) at most 2% of the values apart."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    if not CUDA and ref.dtype == torch.bfloat16:
        assert (out != ref).float().mean().item() <= 0.02


def _check(args, activation="silu", config=None):
    out = M.fused_moe(*args, activation=activation, config=config)
    assert_like_reference(out, RM.fused_moe(*args, activation=activation))
    return out


@DTYPES
@ACTS
@pytest.mark.parametrize(
    "t,e,k", [(37, 4, 1), (21, 4, 2), (11, 16, 8), (1, 16, 2)], ids=["e4k1", "e4k2", "e16k8", "one_token"]
)
def test_fused_moe_matches_reference(dtype, activation, t, e, k):
    args = _problem(t, 40, 24, e, k, dtype, seed=t * e + k)
    _check(args, activation)


@DTYPES
def test_small_tiles_several_chunks(dtype):
    """block 16 against H = 80, I = 48: five K chunks in GEMM 1, three in GEMM 2, ragged N
    blocks; T*k = 38 pairs over 4 experts: groups spanning several M-blocks."""
    args = _problem(19, 80, 48, 4, 2, dtype, seed=7)
    _check(args, "silu", SMALL)
    _check(args, "gelu_tanh", M.MoeConfig(block_m=32, block_n=32, block_k=16))


@DTYPES
def test_expert_without_tokens(dtype):
    """Experts 1 and 2 receive no token: their (empty) groups take no M-block."""
    args = _problem(13, 40, 24, 4, 2, dtype, seed=3, experts_used=[0, 3])
    assert not torch.isin(args[4], torch.tensor([1, 2], device=DEVICE)).any()
    _check(args, "silu", SMALL)


@DTYPES
def test_many_experts_tiny_hidden(dtype):
    """128 experts, top-8, few tokens: most experts idle, every group one padded block."""
    args = _problem(5, 16, 16, 128, 8, dtype, seed=11)
    _check(args, "gelu_tanh" if dtype == torch.float32 else "silu")


def test_routing_weights_scale_each_slot():
    """Doubling one slot's routing weight changes the output by exactly that expert's term
    (float32): the weight multiplies each (token, slot) product, not the token's sum."""
    x, w_gu, w_d, weights, ids = _problem(6, 40, 24, 4, 2, torch.float32, seed=5)
    base = M.fused_moe(x, w_gu, w_d, weights, ids)
    w2 = weights.clone()
    w2[:, 1] *= 2
    only = torch.stack([torch.zeros_like(weights[:, 0]), weights[:, 1]], dim=1)
    torch.testing.assert_close(
        M.fused_moe(x, w_gu, w_d, w2, ids), base + M.fused_moe(x, w_gu, w_d, only, ids), atol=1e-5, rtol=1e-5
    )


def test_no_tokens():
    x, w_gu, w_d, weights, ids = _problem(1, 40, 24, 4, 2, torch.float32, seed=1)
    out = M.fused_moe(x[:0], w_gu, w_d, weights[:0], ids[:0])
    assert out.shape == (0, 40) and out.dtype == torch.float32


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_groups_pairs_by_expert(block_m):
    gen = torch.Generator().manual_seed(block_m)
    t, k, e = 23, 3, 8
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[ids == 5] = 4  # expert 5 empty
    sorted_ids, block_expert = align_pairs(ids.to(DEVICE), e, block_m)
    sorted_ids, block_expert = sorted_ids.cpu().long(), block_expert.cpu().long()
    pairs = t * k
    assert sorted_ids.numel() == block_expert.numel() * block_m
    assert sorted_ids.numel() >= pairs + min(e, pairs) * (block_m - 1)
    real = sorted_ids[sorted_ids < pairs]
    assert torch.equal(real.sort().values, torch.arange(pairs))  # each pair exactly once
    assert (sorted_ids <= pairs).all()
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < pairs]
        if expert >= e:  # tail blocks past the last group hold only the sentinel
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows] == expert).all()
    used = block_expert[block_expert < e]
    assert torch.equal(used, used.sort().values)  # groups in expert order
    assert 5 not in used.tolist()


def _stable_layout(ids: torch.Tensor, e: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout align_pairs must produce, in torch: a stable sort of the pairs by expert, each
    group padded to block_m with the sentinel, and the expert of each M-block."""
    flat = ids.reshape(-1).long()
    pairs = flat.numel()
    padded_len = -(-(pairs + min(e, pairs) * (block_m - 1)) // block_m) * block_m
    counts = torch.bincount(flat, minlength=e)
    ends = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    starts = ends - (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs) - (counts.cumsum(0) - counts)[expert_of]
    sorted_ids = torch.full((padded_len,), pairs, dtype=torch.int64)
    sorted_ids[starts[expert_of] + rank] = order
    return sorted_ids, torch.searchsorted(ends, torch.arange(0, padded_len, block_m), right=True)


@pytest.mark.parametrize("small", [True, False], ids=["one_launch", "three"])
@pytest.mark.parametrize(
    "t,k,e,block_m",
    [(1, 8, 128, 16), (23, 3, 8, 64), (300, 2, 8, 64), (200, 8, 128, 32), (7, 1, 60, 32), (1, 1, 4, 16),
     (40, 8, 256, 16), (300, 8, 64, 16)],
)
def test_align_is_a_stable_sort_by_expert(t, k, e, block_m, small):
    """Pairs of one expert keep their order (several chunks of ALIGN_CHUNK pairs, expert counts
    that are not powers of two, one pair): the same layout, so the same rows, on every run;
    one launch (a decode step's few chunks, here also past SMALL_CHUNKS) or three alike."""
    gen = torch.Generator().manual_seed(t * e)
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[ids == 1] = 0  # an empty expert
    got = align_pairs(ids.to(DEVICE), e, block_m, small)
    want = _stable_layout(ids, e, block_m)
    assert torch.equal(got[0].cpu().long(), want[0]) and torch.equal(got[1].cpu().long(), want[1])


@cuda
@pytest.mark.parametrize("t", [1, 7, 300])
def test_fused_moe_model_sized(t):
    """Mixtral-like per-expert shapes scaled down (H 1024, I 1536, 8 experts, top-2) and a
    Qwen-MoE-like many-expert case (64 experts, top-8), compiled, with default tiles."""
    for h, i, e, k in ((1024, 1536, 8, 2), (512, 256, 64, 8)):
        args = _problem(t, h, i, e, k, torch.bfloat16, seed=t)
        _check(args, "silu")


@pytest.mark.cuda
@cuda
def test_cuda_fused_moe_graph_capture_replay():
    """No host synchronisation: fused_moe captures in a CUDA graph and replays with new
    inputs and a new routing (the padded length depends on T, k and E only)."""
    x, w_gu, w_d, weights, ids = _problem(9, 256, 128, 16, 4, torch.bfloat16, seed=9)
    call = lambda: M.fused_moe(x, w_gu, w_d, weights, ids)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile outside the capture
            call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    for seed in (1, 2):
        new = _problem(9, 256, 128, 16, 4, torch.bfloat16, seed=seed)
        for t, v in zip((x, weights, ids), (new[0], new[3], new[4])):
            t.copy_(v)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(
            out.float(), RM.fused_moe(x, w_gu, w_d, weights, ids).float(), atol=2**-6, rtol=2**-6
        )
