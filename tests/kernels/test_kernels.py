"""Triton kernels == torch references (kernels.reference).

Without a GPU these run on CPU tensors through the Triton interpreter (see
conftest.py), with small shapes; with a GPU the same tests run compiled on CUDA
tensors, and the `cuda`-marked tests add model-sized shapes and CUDA-graph
capture. The kernel modules are called directly: kernels.ops would route CPU
tensors to the reference.

Tolerances: fp32 tight; bf16 about one bf16 ulp for the elementwise kernels
(they reproduce the reference's rounding steps) and 2e-2 for attention (a bf16
reference accumulates differently).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import activation, attention, kv_store, norm, ops, reference, rope
from tests.kernels.device import CUDA, DEVICE, cuda

ATTN_TOL = {torch.float32: 1e-4 if CUDA else 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# one-ish ulp of the output dtype for kernels that replicate the reference's roundings
ELEM_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _close(out, ref, tol):
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# --------------------------------------------------------------------------- paged cache helpers


def _paged_cache(ctx_lens, page_size, kvh, d, dtype, gen, spare_pages=3):
    """Random K/V for sequences of `ctx_lens` tokens, scattered over shuffled pages.

    Returns k_cache, v_cache [P, S, KVH, D] and page_table [B, max_pages] whose
    unused entries are -1 (a kernel that reads them would fault / mismatch).
    """
    n_pages = [(n + page_size - 1) // page_size for n in ctx_lens]
    total = sum(n_pages) + spare_pages
    k_cache = torch.randn(total, page_size, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(total, page_size, kvh, d, generator=gen).to(dtype)
    perm = torch.randperm(total, generator=gen)
    width = max(n_pages) + 1
    page_table = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_pages):
        page_table[b, :n] = perm[used : used + n].int()
        used += n
    return k_cache.to(DEVICE), v_cache.to(DEVICE), page_table.to(DEVICE)


def _decode_case(seq_lens, page_size, gqa, d, dtype, kvh=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = kvh * gqa
    k_cache, v_cache, page_table = _paged_cache(seq_lens, page_size, kvh, d, dtype, gen)
    q = torch.randn(len(seq_lens), h, d, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, page_table, lens


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def token_major(cache):
    """The same values with each page's tokens adjacent (a float8 PagePool's V layout)."""
    out = cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert _same_bits(out, cache) and (out.stride(1) == 1 or out.shape[1] == 1)
    return out


def head_major(cache):
    """The same values with each page's rows of one head adjacent (a float8 PagePool's K layout)."""
    out = cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert _same_bits(out, cache) and (out.stride(1) == cache.shape[-1] or out.shape[1] == 1)
    return out


def _decode_ref(q, k_cache, v_cache, page_table, seq_lens, scale):
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return reference.paged_attention(q, k_cache, v_cache, page_table, seq_lens, cu, scale)


# --------------------------------------------------------------------------- paged_decode

SEQ_LENS = [1, 7, 33, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_paged_decode_matches_reference(dtype, page_size, gqa):
    d = 64 if gqa != 4 else 128
    q, kc, vc, pt, lens = _decode_case(SEQ_LENS, page_size, gqa, d, dtype)
    scale = 1 / math.sqrt(d)
    out = attention.paged_decode(q, kc, vc, pt, lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    _close(out, _decode_ref(q, kc, vc, pt, lens, scale), ATTN_TOL[dtype])


# kernel variants of paged_decode: (prefetch, head_major)
DECODE_VARIANTS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("prefetch,head_major", DECODE_VARIANTS)
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("d", [64, 128])
def test_paged_decode_splits_and_variants(num_splits, d, prefetch, head_major):
    """Any split count (including splits left empty for short sequences) and kernel variant
    gives the reference result."""
    q, kc, vc, pt, lens = _decode_case([3, 100, 40], 16, 4, d, torch.float32, seed=1)
    scale = 1 / math.sqrt(d)
    out = attention.paged_decode(
        q,
        kc,
        vc,
        pt,
        lens,
        scale,
        num_splits=num_splits,
        block_n=16,
        prefetch=prefetch,
        head_major=head_major,
    )
    _close(out, _decode_ref(q, kc, vc, pt, lens, scale), ATTN_TOL[torch.float32])


def test_splits_past_the_keys_read_and_write_no_partial_output(monkeypatch):
    """A split that sees no key (a short sequence in a graph sized for long ones) loads nothing and
    stores only its -inf log-sum-exp; the merge skips its partial output, left as allocated (NaN
    here, so that reading it would show)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    q, kc, vc, pt, lens = _decode_case([3, 100, 40], 16, 4, 64, torch.float32, seed=2)
    monkeypatch.setattr(torch, "empty", nan_empty)
    out = attention.paged_decode(q, kc, vc, pt, lens, 0.125, num_splits=8, block_n=16)
    monkeypatch.undo()
    assert not out.isnan().any()
    _close(out, _decode_ref(q, kc, vc, pt, lens, 0.125), ATTN_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size,block_n", [(16, 16), (16, 32), (32, 64)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("v_layout", ["d-major", "token-major"])
def test_paged_decode_subtiles(dtype, page_size, block_n, num_splits, v_layout):
    """Whole key blocks read as 16-token sub-tiles of pages (one or several sub-tiles per
    page, several pages per block), the last partial block through the masked path; lengths
    on and off block boundaries; V in either layout."""
    q, kc, vc, pt, lens = _decode_case([1, 16, 31, 64, 100, 130], page_size, 4, 64, dtype, seed=3)
    if v_layout == "token-major":
        vc = token_major(vc)
    out = attention.paged_decode(q, kc, vc, pt, lens, 0.125, num_splits=num_splits, block_n=block_n, subtile=True)
    _close(out, _decode_ref(q, kc, vc, pt, lens, 0.125), ATTN_TOL[dtype])


def test_paged_decode_strided_query_and_max_seq_len_hint():
    """q may be a strided view (e.g. of a fused qkv buffer); the split hint changes nothing."""
    q, kc, vc, pt, lens = _decode_case([9, 70], 4, 2, 64, torch.float32, seed=2)
    big = torch.zeros(q.shape[0], q.shape[1] + 3, 64, device=DEVICE)
    big[:, 1 : 1 + q.shape[1]] = q
    qv = big[:, 1 : 1 + q.shape[1]]
    assert not qv.is_contiguous()
    ref = _decode_ref(q, kc, vc, pt, lens, 0.3)
    for hint in (None, 70, 10_000):
        _close(
            attention.paged_decode(qv, kc, vc, pt, lens, 0.3, max_seq_len=hint),
            ref,
            2e-5 if not CUDA else 1e-4,
        )


# --------------------------------------------------------------------------- paged_extend


def _extend_case(prefixes, q_lens, page_size, gqa, d, dtype, kvh=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = kvh * gqa
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    k_cache, v_cache, page_table = _paged_cache(seq_lens, page_size, kvh, d, dtype, gen)
    q = torch.randn(sum(q_lens), h, d, generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, page_table, lens, cu


# (cached prefix, new tokens) per sequence: fresh prefill, decode-like single token,
# chunked prefill continuing a cached prefix, odd lengths straddling pages/blocks
EXTEND_MIX = ([0, 0, 26, 5, 0], [7, 1, 33, 2, 40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_paged_extend_matches_reference(dtype, page_size, gqa):
    d = 64 if gqa != 4 else 128
    prefixes, q_lens = EXTEND_MIX
    kvh = 1 if gqa == 8 else 2  # keeps the interpreter's program count small
    q, kc, vc, pt, lens, cu = _extend_case(prefixes, q_lens, page_size, gqa, d, dtype, kvh=kvh)
    scale = 1 / math.sqrt(d)
    out = attention.paged_extend(q, kc, vc, pt, lens, cu, scale, max(q_lens))
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference.paged_attention(q, kc, vc, pt, lens, cu, scale)
    _close(out, ref, ATTN_TOL[dtype])


@pytest.mark.parametrize("page_size,subtile", [(1, None), (16, False), (16, True), (32, True)])
@pytest.mark.parametrize("v_layout", ["d-major", "token-major"])
def test_paged_extend_subtiles_and_v_layouts(page_size, subtile, v_layout):
    """Key blocks addressed per token or as 16-token sub-tiles of pages, over V in either
    layout (sub-tiles are the default for token-major V)."""
    prefixes, q_lens = [0, 5, 40, 64], [9, 1, 30, 17]
    q, kc, vc, pt, lens, cu = _extend_case(prefixes, q_lens, page_size, 4, 64, torch.float32)
    v = token_major(vc) if v_layout == "token-major" else vc
    out = attention.paged_extend(q, kc, v, pt, lens, cu, 0.125, max(q_lens), block_n=16, subtile=subtile)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125), ATTN_TOL[torch.float32])


def test_paged_extend_long_prefix_small_blocks():
    """Several unmasked key blocks before the causal diagonal, query blocks split mid-sequence."""
    q, kc, vc, pt, lens, cu = _extend_case([100, 0], [33, 20], 16, 4, 64, torch.float32, seed=3)
    out = attention.paged_extend(q, kc, vc, pt, lens, cu, 0.125, 33, block_m=16, block_n=16)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125), ATTN_TOL[torch.float32])


def test_paged_extend_single_tokens_equal_decode():
    q, kc, vc, pt, lens = _decode_case([5, 64], 16, 4, 64, torch.float32, seed=4)
    cu = torch.arange(3, dtype=torch.int32, device=DEVICE)
    ext = attention.paged_extend(q, kc, vc, pt, lens, cu, 0.125, 1)
    dec = attention.paged_decode(q, kc, vc, pt, lens, 0.125)
    _close(ext, dec, 1e-5)


def test_paged_extend_zero_length_sequence():
    """A sequence with no new queries (cu_q_lens repeats) is skipped."""
    q, kc, vc, pt, lens, cu = _extend_case([3, 4, 0], [5, 0, 3], 4, 1, 64, torch.float32, seed=5)
    out = attention.paged_extend(q, kc, vc, pt, lens, cu, 0.125, 5)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125), ATTN_TOL[torch.float32])


def test_extend_tiles_lists_every_query_block_once():
    """Tile b << 16 | m for each query block m of sequence b, then -1 padding."""
    tiles = attention.extend_tiles([5, 0, 64, 65], 32, pad_to=12)
    assert tiles.tolist() == [0, (2 << 16), (2 << 16) | 1, (3 << 16), (3 << 16) | 1, (3 << 16) | 2] + [-1] * 6
    # the bound a padded CUDA graph relies on: cdiv(total, block) + number of sequences
    for q_lens in ([1] * 9, [100, 3, 29], [64, 64]):
        assert len(attention.extend_tiles(q_lens, 32)) <= -(-sum(q_lens) // 32) + len(q_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_extend_with_padded_tile_list_matches_reference(dtype):
    """The tile-list grid (what a padded CUDA graph launches) computes the same attention;
    padding tiles do nothing and a grid sized by an upper bound covers every query."""
    prefixes, q_lens = EXTEND_MIX
    q, kc, vc, pt, lens, cu = _extend_case(prefixes, q_lens, 16, 4, 64, dtype, kvh=1)
    tiles = torch.from_numpy(attention.extend_tiles(q_lens, 16, pad_to=20)).to(DEVICE)
    out = attention.paged_extend(q, kc, vc, pt, lens, cu, 0.125, 64, block_m=16, tiles=tiles)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125), ATTN_TOL[dtype])


ODD_SHAPES = [
    # page_size, head_dim, gqa, dtype: other powers of two, a non-power-of-two head dim
    # and GQA group, fp16
    (4, 32, 2, torch.float16),
    (8, 80, 3, torch.float32),
    (2, 256, 1, torch.bfloat16),
]


@pytest.mark.parametrize("page_size,d,gqa,dtype", ODD_SHAPES)
def test_paged_attention_odd_shapes(page_size, d, gqa, dtype):
    scale = 1 / math.sqrt(d)
    q, kc, vc, pt, lens = _decode_case([1, 7, 33], page_size, gqa, d, dtype, kvh=1, seed=6)
    _close(
        attention.paged_decode(q, kc, vc, pt, lens, scale),
        _decode_ref(q, kc, vc, pt, lens, scale),
        ATTN_TOL[dtype],
    )
    q, kc, vc, pt, lens, cu = _extend_case([0, 9], [7, 12], page_size, gqa, d, dtype, kvh=1, seed=7)
    out = attention.paged_extend(q, kc, vc, pt, lens, cu, scale, 12)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, scale), ATTN_TOL[dtype])


# --------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
    ids=["fp32", "bf16", "fp32->bf16"],
)
def test_store_kv_matches_reference(page_size, dtype, cache_dtype):
    gen = torch.Generator().manual_seed(0)
    t, kvh, d = 9, 2, 64
    pages = (2 * t) // page_size + 1
    qkv = torch.randn(t, 4 + 2 * kvh, d, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, 4 : 4 + kvh], qkv[:, 4 + kvh :]  # strided views, as from a fused qkv projection
    slots = torch.randperm(pages * page_size, generator=gen)[:t].int()
    slots[[2, 5]] = -1  # padding entries are skipped
    slots = slots.to(DEVICE)
    caches = [
        torch.randn(pages, page_size, kvh, d, generator=gen).to(cache_dtype).to(DEVICE) for _ in range(2)
    ]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    v_tm, ref_v_tm = token_major(caches[1]), token_major(caches[1])
    reference.store_kv(k, v, ref_k, ref_v, slots)
    kv_store.store_kv(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], ref_k) and torch.equal(caches[1], ref_v)
    # a token-major V cache gets the same values, through the kernel and the reference
    kv_store.store_kv(k, v, caches[0], v_tm, slots)
    reference.store_kv(k, v, ref_k, ref_v_tm, slots)
    assert torch.equal(v_tm, ref_v) and torch.equal(ref_v_tm, ref_v)


def _rotary_store_inputs(gen, t, h, kvh, d, page_size, dtype, padding, scale=None):
    """q, k, v (strided views of one qkv projection, rows times `scale`), positions, cos/sin,
    slots (those at `padding` are -1) and the page count of a rotary_store case."""
    pages = (2 * t) // page_size + 2
    qkv = torch.randn(t, h + 2 * kvh, d, generator=gen)
    if scale is not None:
        qkv = qkv * scale[:, None, None]
    qkv = qkv.to(dtype).to(DEVICE)
    q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
    positions = torch.randint(0, 50, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(pages * page_size, generator=gen)[:t].int()
    slots[padding] = -1
    return q, k, v, positions, _cos_sin(64, d).to(DEVICE), slots.to(DEVICE), pages


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("d,kvh", [(64, 2), (80, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_equals_rotary_then_store_kv(page_size, d, kvh, dtype):
    """The fused kernel: q rotated, k rotated into its slot, v copied into its slot; padding
    slots (-1) write nothing; inputs are strided views of one qkv projection."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, positions, cs, slots, pages = _rotary_store_inputs(gen, 7, 4, kvh, d, page_size, dtype, [1, 4])
    caches = [torch.randn(pages, page_size, kvh, d, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    q_ref, k_rot = reference.rotary(q, k, positions, cs)
    reference.store_kv(k_rot, v, ref_k, ref_v, slots)
    q_out = rope.rotary_store(q, k, v, positions, cs, caches[0], caches[1], slots)
    _close(q_out, q_ref, ELEM_TOL[dtype])
    _close(caches[0], ref_k, ELEM_TOL[dtype])
    assert torch.equal(caches[1], ref_v)


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_with_qk_norm_equals_rms_norm_then_rotary_store(offset, dtype):
    """q/k RMSNorm per head fused into the launch (Qwen3, Gemma 3's offset 1): the same q and
    cache as rms_norm over head_dim with each weight, then rotary and store."""
    gen = torch.Generator().manual_seed(3)
    t, h, kvh, d, page_size = 6, 4, 2, 64, 16
    q, k, v, positions, cs, slots, pages = _rotary_store_inputs(gen, t, h, kvh, d, page_size, dtype, [2])
    qw, kw = ((1 + 0.2 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE) for _ in range(2))
    caches = [torch.zeros(pages, page_size, kvh, d, dtype=dtype, device=DEVICE) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    qn = reference.rms_norm(q.reshape(-1, d), qw, 1e-6, offset).view(t, h, d)
    kn = reference.rms_norm(k.reshape(-1, d), kw, 1e-6, offset).view(t, kvh, d)
    q_ref, k_rot = reference.rotary(qn, kn, positions, cs)
    reference.store_kv(k_rot, v, ref_k, ref_v, slots)
    q_out = rope.rotary_store(q, k, v, positions, cs, caches[0], caches[1], slots, (qw, kw, 1e-6, offset))
    _close(q_out, q_ref, ELEM_TOL[dtype])
    _close(caches[0], ref_k, ELEM_TOL[dtype])
    assert torch.equal(caches[1], ref_v)
    via_ops = ops.rotary_store(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), cs.cpu(), ref_k.cpu() * 0,
                               ref_v.cpu() * 0, slots.cpu(), (qw.cpu(), kw.cpu(), 1e-6, offset))
    _close(via_ops.to(DEVICE), q_ref, ELEM_TOL[dtype])  # the torch path (CPU engines) applies the same norms


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_into_float8_pool_pages_equals_rotary_then_store_kv(page_size, dtype):
    """Float8 pages in a float8 PagePool's layouts (K head-major, V token-major): the fused
    kernel stores the same bytes as the rotary kernel followed by the store kernel (k rounded
    to q's dtype, then to e4m3, saturated), and returns the same q; padding slots write nothing."""
    gen = torch.Generator().manual_seed(2)
    t, kvh, d = 9, 2, 64
    q, k, v, positions, cs, slots, pages = _rotary_store_inputs(
        gen, t, 4, kvh, d, page_size, dtype, [0, 5], scale=torch.logspace(-3, 3, t)
    )
    fp8 = torch.float8_e4m3fn
    fresh = torch.randn(pages, page_size, kvh, d, generator=gen).to(fp8).to(DEVICE)
    kc, vc = head_major(fresh.clone()), token_major(fresh.clone())
    ref_k, ref_v = head_major(fresh.clone()), token_major(fresh.clone())
    q_out = rope.rotary_store(q, k, v, positions, cs, kc, vc, slots)
    q_rot, k_rot = rope.rotary(q, k, positions, cs)
    kv_store.store_kv(k_rot, v, ref_k, ref_v, slots)
    assert torch.equal(q_out, q_rot)
    assert _same_bits(kc, ref_k) and _same_bits(vc, ref_v)
    written = set(slots[slots >= 0].tolist())
    assert written and not (kc.view(torch.uint8) == fresh.view(torch.uint8)).all()
    for s in set(range(pages * page_size)) - written:
        page, off = divmod(s, page_size)
        assert _same_bits(kc[page, off], fresh[page, off]) and _same_bits(vc[page, off], fresh[page, off])


# --------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("hidden", [64, 100])
@pytest.mark.parametrize(
    "dtype,w_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16", "bf16-fp32w"],
)
def test_rms_norm_matches_reference(hidden, dtype, w_dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(w_dtype).to(DEVICE)
    out = norm.rms_norm(x, w, 1e-6)
    ref = reference.rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    _close(out, ref, ELEM_TOL[ref.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_add_rms_norm_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 96, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(6, 96, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(96, generator=gen).to(dtype).to(DEVICE)
    x0, res0 = x.clone(), res.clone()
    out, new_res = norm.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)  # the residual add is exact in x.dtype
    _close(out, ref_out, ELEM_TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


# --------------------------------------------------------------------------- rotary


def _cos_sin(max_pos, d, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_matches_reference(d, dtype):
    gen = torch.Generator().manual_seed(0)
    t, h, kvh = 7, 4, 2
    qkv = torch.randn(t, h + 2 * kvh, d, generator=gen).to(dtype).to(DEVICE)
    q, k = qkv[:, :h], qkv[:, h : h + kvh]  # strided views of a fused projection
    positions = torch.tensor([0, 1, 2, 17, 300, 511, 5], device=DEVICE)
    cs = _cos_sin(512, d).to(DEVICE)
    q_out, k_out = rope.rotary(q, k, positions, cs)
    q_ref, k_ref = reference.rotary(q, k, positions, cs)
    assert q_out.shape == q_ref.shape and k_out.dtype == k_ref.dtype
    _close(q_out, q_ref, ELEM_TOL[dtype])
    _close(k_out, k_ref, ELEM_TOL[dtype])


# --------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("inter", [64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_and_mul_matches_reference(inter, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 2 * inter, generator=gen) * 4).to(dtype).to(DEVICE)
    out = activation.silu_and_mul(x)
    ref = reference.silu_and_mul(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _close(out, ref, ELEM_TOL[dtype])


# --------------------------------------------------------------------------- GPU sizes


# dtype, page_size, gqa, head_dim of the model-sized GPU cases
CUDA_ATTN_CASES = [
    (torch.bfloat16, 16, 4, 128),
    (torch.bfloat16, 1, 8, 128),
    (torch.bfloat16, 16, 1, 64),
    (torch.bfloat16, 32, 8, 256),
    (torch.float16, 16, 4, 128),
    (torch.float32, 16, 4, 128),
    (torch.float32, 1, 8, 64),
]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype,page_size,gqa,d", CUDA_ATTN_CASES)
def test_cuda_paged_decode_large(dtype, page_size, gqa, d):
    seq_lens = [1, 17, 255, 1000, 2047, 4100, 333, 64]
    q, kc, vc, pt, lens = _decode_case(seq_lens, page_size, gqa, d, dtype, kvh=4)
    scale = 1 / math.sqrt(d)
    ref = _decode_ref(q.float(), kc.float(), vc.float(), pt, lens, scale)
    _close(attention.paged_decode(q, kc, vc, pt, lens, scale), ref, ATTN_TOL[dtype])
    for prefetch, head_major in DECODE_VARIANTS:
        for splits in (1, 7):
            out = attention.paged_decode(
                q, kc, vc, pt, lens, scale, num_splits=splits, prefetch=prefetch, head_major=head_major
            )
            _close(out, ref, ATTN_TOL[dtype])


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype,page_size,gqa,d", CUDA_ATTN_CASES)
def test_cuda_paged_extend_large(dtype, page_size, gqa, d):
    """Both grids: (query blocks, heads, sequences), and a padded tile list as the CUDA
    graphs of prefill steps launch it (a grid sized by an upper bound)."""
    prefixes = [0, 0, 700, 129, 0, 2000]
    q_lens = [1, 300, 77, 513, 64, 5]
    q, kc, vc, pt, lens, cu = _extend_case(prefixes, q_lens, page_size, gqa, d, dtype, kvh=4)
    scale = 1 / math.sqrt(d)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), pt, lens, cu, scale)
    _close(attention.paged_extend(q, kc, vc, pt, lens, cu, scale, max(q_lens)), ref, ATTN_TOL[dtype])
    bm = attention.extend_block_m(dtype, d)
    tiles = torch.from_numpy(attention.extend_tiles(q_lens, bm, pad_to=64)).to(DEVICE)
    out = attention.paged_extend(q, kc, vc, pt, lens, cu, scale, 1024, block_m=bm, tiles=tiles)
    _close(out, ref, ATTN_TOL[dtype])


@pytest.mark.cuda
@cuda
def test_cuda_decode_graph_capture_replay():
    """paged_decode and the small kernels capture in a CUDA graph and replay with new lengths."""
    dtype = torch.bfloat16
    q, kc, vc, pt, lens = _decode_case([100, 2000, 37, 900], 16, 4, 128, dtype, kvh=8)
    static_lens = lens.clone()
    scale = 1 / math.sqrt(128)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up compiles outside the capture
            attention.paged_decode(q, kc, vc, pt, static_lens, scale)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attention.paged_decode(q, kc, vc, pt, static_lens, scale)
    for new in ([100, 2000, 37, 900], [1, 1999, 5, 64]):  # within each sequence's pages
        static_lens.copy_(torch.tensor(new, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        ref = _decode_ref(q.float(), kc.float(), vc.float(), pt, static_lens, scale)
        _close(out, ref, ATTN_TOL[dtype])


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_cuda_elementwise_large(dtype):
    gen = torch.Generator().manual_seed(0)
    t, hidden, inter, h, kvh, d = 257, 4096, 11008, 32, 8, 128
    x = torch.randn(t, hidden, generator=gen).to(dtype).cuda()
    res = torch.randn(t, hidden, generator=gen).to(dtype).cuda()
    w = torch.randn(hidden, generator=gen).to(dtype).cuda()
    _close(norm.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), ELEM_TOL[dtype])
    out, new_res = norm.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = reference.fused_add_rms_norm(x, res, w, 1e-6)
    _close(out, ref_out, ELEM_TOL[dtype])
    _close(new_res, ref_res, 0)
    g = torch.randn(t, 2 * inter, generator=gen).to(dtype).cuda()
    _close(activation.silu_and_mul(g), reference.silu_and_mul(g), ELEM_TOL[dtype])
    qkv = torch.randn(t, h + 2 * kvh, d, generator=gen).to(dtype).cuda()
    q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
    pos = torch.randint(0, 4096, (t,), generator=gen).cuda()
    cs = _cos_sin(4096, d).cuda()
    for a, b in zip(rope.rotary(q, k, pos, cs), reference.rotary(q, k, pos, cs)):
        _close(a, b, ELEM_TOL[dtype])
    kc = torch.zeros(64, 16, kvh, d, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    slots = torch.randperm(64 * 16, generator=gen)[:t].int().cuda()
    slots[::7] = -1
    rk, rv = kc.clone(), vc.clone()
    reference.store_kv(k, v, rk, rv, slots)
    kv_store.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    fk, fv = torch.zeros_like(kc), torch.zeros_like(vc)
    q_rot, k_rot = reference.rotary(q, k, pos, cs)
    reference.store_kv(k_rot, v, rk, rv, slots)
    _close(rope.rotary_store(q, k, v, pos, cs, fk, fv, slots), q_rot, ELEM_TOL[dtype])
    _close(fk, rk, ELEM_TOL[dtype])
    assert torch.equal(fv, rv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_step_split_into_decode_and_extend_matches_reference(dtype, monkeypatch):
    """kernels.ops.paged_attention with num_decodes: the leading one-token sequences through
    the decode kernel, the rest (their query offsets shifted) through the extend kernel."""
    from kernels import ops

    monkeypatch.setattr(ops, "_triton", lambda x: True)  # the kernels, interpreted on CPU
    prefixes, q_lens = [40, 3, 17, 0, 26], [1, 1, 1, 9, 20]
    q, kc, vc, pt, lens, cu = _extend_case(prefixes, q_lens, 16, 4, 64, dtype, kvh=2, seed=4)
    scale = 1 / math.sqrt(64)
    out = ops.paged_attention(q, kc, vc, pt, lens, cu, scale, max(q_lens), num_decodes=3)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, scale), ATTN_TOL[dtype])


def test_attention_kernels_write_into_a_given_output_view():
    """paged_decode and paged_extend given `out` (rows of a larger tensor, as a mixed step's
    split passes them) write their result there, and only there: no copy afterwards."""
    from kernels import attention

    q, kc, vc, pt, lens = _decode_case([33, 7, 20], 16, 4, 64, torch.float32)
    for splits in (1, 2):  # (2: the partial results' reduce writes the view)
        whole = torch.full((5, *q.shape[1:]), 7.0, device=q.device)
        got = attention.paged_decode(q, kc, vc, pt, lens, 0.125, num_splits=splits, out=whole[1:4])
        assert got.data_ptr() == whole[1].data_ptr()
        _close(whole[1:4], attention.paged_decode(q, kc, vc, pt, lens, 0.125), 1e-6)
        assert (whole[0] == 7).all() and (whole[4] == 7).all()

    q, kc, vc, pt, lens, cu = _extend_case([5, 0], [9, 12], 16, 2, 64, torch.float32)
    whole = torch.full((q.shape[0] + 2, *q.shape[1:]), 7.0, device=q.device)
    got = attention.paged_extend(q, kc, vc, pt, lens, cu, 0.125, 12, out=whole[2:])
    assert got.data_ptr() == whole[2].data_ptr()
    _close(whole[2:], attention.paged_extend(q, kc, vc, pt, lens, cu, 0.125, 12), 1e-6)
    assert (whole[:2] == 7).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_rows_split_as_batch_one_give_each_the_bits_of_a_lone_decode(dtype):
    """A verify step's rows as decode rows (one sequence at lengths L+1 .. L+9, one page table):
    with split_batch=1 each row is split as a lone decode of its length is, so its output has
    that decode's bits (the split count of a 9-row batch would be another)."""
    q, kc, vc, pt, lens = _decode_case([300], 16, 4, 64, dtype, kvh=1, seed=4)
    rows = 9
    qs = torch.randn(rows, *q.shape[1:], generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    # a page table as wide as a graph's for 8,192 tokens: split counts follow its width, and
    # a lone decode's (64 on the H200, 16 here) is not a 9-row batch's (58, 1)
    pt = torch.cat([pt, pt.new_zeros(1, 512 - pt.shape[1])], dim=1)
    assert attention.splits._choose_splits(1, 1, 512 * 16, 32, q.device) != \
        attention.splits._choose_splits(rows, 1, 512 * 16, 32, q.device)
    pts = pt.expand(rows, -1).contiguous()
    row_lens = torch.arange(292, 292 + rows, dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(64)
    out = attention.paged_decode(qs, kc, vc, pts, row_lens, scale, split_batch=1)
    for i in range(rows):
        alone = attention.paged_decode(qs[i : i + 1], kc, vc, pt, row_lens[i : i + 1], scale)
        assert torch.equal(out[i], alone[0]), i
    _close(out, _decode_ref(qs, kc, vc, pts, row_lens, scale), ATTN_TOL[dtype])
