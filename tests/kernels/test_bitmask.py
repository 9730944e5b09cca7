"""kernels.bitmask (grammar bitmask applied to logits in place) == the unpacked definition.

On CPU through the Triton interpreter (small vocabularies, not multiples of 32 or of the
block); on a GPU compiled, plus a 128k vocabulary."""

from __future__ import annotations

import pytest
import torch

from kernels import bitmask
from tests.kernels.device import DEVICE, cuda


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, V] -> int32 words [R, ceil(V / 32)]: bit t % 32 of word t // 32."""
    r, v = allowed.shape
    padded = torch.zeros(r, -(-v // 32) * 32, dtype=torch.int64)
    padded[:, :v] = allowed.long()
    words = (padded.view(r, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def expected(logits: torch.Tensor, allowed: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]) if rows is None else rows:
        out[r][~allowed[r]] = float("-inf")
    return out


@pytest.mark.parametrize("v", [5, 70, 4096 + 33])
@pytest.mark.parametrize("rows", [None, [0, 2]], ids=["all_rows", "some_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_apply_bitmask_sets_disallowed_tokens_to_minus_inf(v, rows, dtype):
    gen = torch.Generator().manual_seed(v)
    logits = torch.randn(3, v, generator=gen).to(dtype)
    allowed = torch.rand(3, v, generator=gen) < 0.3
    allowed[1] = True  # an all-ones row changes nothing
    want = expected(logits, allowed, rows)
    got = logits.to(DEVICE)
    idx = None if rows is None else torch.tensor(rows, device=DEVICE)
    bitmask.apply_bitmask_(got, pack(allowed).to(DEVICE), idx)
    assert torch.equal(got.cpu(), want)


def test_tokens_past_the_mask_width_are_disallowed():
    logits = torch.zeros(2, 40)
    words = torch.full((2, 1), -1, dtype=torch.int32)  # 32 tokens allowed, 8 not covered
    got = logits.to(DEVICE)
    bitmask.apply_bitmask_(got, words.to(DEVICE))
    assert torch.isneginf(got[:, 32:].cpu()).all() and not torch.isneginf(got[:, :32].cpu()).any()


@pytest.mark.cuda
@cuda
def test_cuda_apply_bitmask_full_vocabulary():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 128256, generator=gen)
    allowed = torch.rand(64, 128256, generator=gen) < 0.01
    want = expected(logits, allowed, list(range(0, 64, 3)))
    got = logits.cuda()
    bitmask.apply_bitmask_(got, pack(allowed).cuda(), torch.arange(0, 64, 3, device="cuda"))
    assert torch.equal(got.cpu(), want)
