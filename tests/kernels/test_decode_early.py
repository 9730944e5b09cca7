"""Decode attention that reads each split's first key block before its PDL wait (`paged_decode`'s
early, the default for batches up to EARLY_BATCH): the same bits as reading it after, for any
split count, window, soft-cap and sink, including splits left empty and one-token sequences.
(The new token's row is read again after the wait: on the GPU, tests/gpu's PDL test checks that
nothing read early was still being written.)"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import attention
from kernels.attention.decode import EARLY_BATCH
from tests.kernels.test_kernels import _decode_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (24, 20.0)])
def test_the_first_block_read_early_gives_the_same_bits(dtype, num_splits, window, softcap):
    q, kc, vc, pt, lens = _decode_case([1, 70, 33, 130], 16, 4, 64, dtype, seed=num_splits)
    sinks = torch.linspace(-1, 1, q.shape[1]).to(q.device)
    kw = {"num_splits": num_splits, "block_n": 16, "window": window, "softcap": softcap, "sinks": sinks}
    early = attention.paged_decode(q, kc, vc, pt, lens, 1 / math.sqrt(64), early=True, **kw)
    late = attention.paged_decode(q, kc, vc, pt, lens, 1 / math.sqrt(64), early=False, **kw)
    assert torch.equal(early, late)


def test_early_is_the_default_for_few_sequences_and_never_for_verify_rows(monkeypatch):
    from kernels.attention import decode

    seen = []
    real = decode._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["EARLY"])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(decode, "_decode_kernel", Spy())
    for batch, split_batch in ((1, None), (EARLY_BATCH, None), (EARLY_BATCH + 1, None), (2, 1)):
        q, kc, vc, pt, lens = _decode_case([20] * batch, 16, 2, 64, torch.float32)
        attention.paged_decode(q, kc, vc, pt, lens, 0.125, split_batch=split_batch)
    assert seen == [True, True, False, False]
