"""kernels.gemv (decode GEMV, M <= 4) == torch references.

Without a GPU these run on CPU tensors through the Triton interpreter (see
conftest.py) with small, odd shapes; with a GPU the same tests run compiled,
and the `cuda`-marked tests add model-sized shapes and CUDA-graph capture.

The references are here rather than in kernels.reference because the engine's
CPU path is F.linear itself: `linear` is F.linear, `glu` the unfused gate_up
projection and activation (F.linear, then kernels.reference.silu_and_mul).

Tolerances: the kernel accumulates in fp32 and rounds once, like the bf16
reference, but in another order, so the two may differ by one output ulp
(2^-7 relative in bf16); fp32 differs by summation order only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv as G
from tests.kernels.device import CUDA, DEVICE, cuda

TOL = {torch.float32: 1e-4, torch.bfloat16: 2**-7, torch.float16: 2**-10}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

# Small tiles so the interpreter runs several chunks, splits and row blocks on small shapes.
CONFIGS = {
    "default": None,
    "split3": G.GemvConfig(block_n=4, block_k=32, unroll=2, split_k=3),
    "acc1d_split2": G.GemvConfig(block_n=16, block_k=32, unroll=1, split_k=2, acc_1d=True),
    "tiny_k": G.GemvConfig(block_n=8, block_k=16, unroll=3, split_k=5),
}


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _close(out, ref, tol):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@DTYPES
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
def test_gemv_matches_linear(dtype, m, cfg):
    gen = torch.Generator().manual_seed(m)
    n, k = 37, 200  # neither a multiple of any block
    x = _rand(m, k, dtype=dtype, gen=gen)
    w = _rand(n, k, dtype=dtype, gen=gen, scale=k**-0.5)
    _close(G.gemv(x, w, CONFIGS[cfg]), linear(x, w), TOL[dtype])


def glu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The unfused decode MLP's first half: gate_up projection, then kernels.reference.silu_and_mul."""
    from kernels import reference

    return reference.silu_and_mul(F.linear(x, w))


GLU_CONFIGS = {
    "default": None,
    "small_tiles": G.GemvConfig(block_n=4, block_k=32, unroll=2, num_warps=4),
    "one_chunk": G.GemvConfig(block_n=16, block_k=16, unroll=1, num_warps=4),
}


@DTYPES
@pytest.mark.parametrize("cfg", list(GLU_CONFIGS), ids=list(GLU_CONFIGS))
@pytest.mark.parametrize("k", [200, 128], ids=["ragged_k", "even_k"])
def test_gemv_glu_matches_silu_and_mul_of_linear(dtype, cfg, k):
    gen = torch.Generator().manual_seed(k)
    inter = 37  # W is [gate; up] = [74, K]; 37 rows is no multiple of any tile
    x = _rand(1, k, dtype=dtype, gen=gen)
    w = _rand(2 * inter, k, dtype=dtype, gen=gen, scale=2 * k**-0.5)
    out = G.gemv_glu(x, w, GLU_CONFIGS[cfg])
    _close(out, glu(x, w), 2 * TOL[dtype])  # one ulp in gate or up may move the product by two
    assert G.gemv_glu(x[0], w).shape == (inter,)


def test_gemv_more_rows_leading_dims_and_strides():
    """M > 4 (row blocks of 4), leading dims, strided x and W (row pitch > K), fp32 x with a bf16 W."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16
    x = _rand(2, 3, 48, dtype=dtype, gen=gen)
    w = _rand(19, 48, dtype=dtype, gen=gen, scale=48**-0.5)
    _close(G.gemv(x, w), linear(x, w), TOL[dtype])
    xs = _rand(3, 96, dtype=dtype, gen=gen)[:, ::2]
    _close(G.gemv(xs, w), linear(xs, w), TOL[dtype])
    wp = _rand(19, 64, dtype=dtype, gen=gen, scale=48**-0.5)[:, :48]
    assert not wp.is_contiguous() and wp.stride(-1) == 1
    _close(G.gemv(x[0], wp), linear(x[0], wp), TOL[dtype])
    x32 = _rand(2, 48, dtype=torch.float32, gen=gen)  # fp32 activations, bf16 weight: fp32 out
    _close(G.gemv(x32, w), linear(x32, w.float()), TOL[torch.float32])


def test_gemv_exact_multiples_and_empty():
    """The unmasked (EVEN_K) path: K a multiple of block_k * unroll * split; and zero rows."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16
    x = _rand(2, 128, dtype=dtype, gen=gen)
    w = _rand(16, 128, dtype=dtype, gen=gen, scale=128**-0.5)
    for cfg in (G.GemvConfig(block_n=8, block_k=32, unroll=2, split_k=2), G.GemvConfig(block_k=64, unroll=2)):
        _close(G.gemv(x, w, cfg), linear(x, w), TOL[dtype])
    assert G.gemv(x[:0], w).shape == (0, 16)


def test_config_heuristic_and_use_gemv():
    # 4096 x 4096: 1024 programs of 4 rows fill 132 SMs without splitting K.
    assert G.gemv_config(1, 4096, 4096).split_k == 1
    # Qwen3-0.6B o_proj (N 1024, K 2048): 256 programs, so K is split.
    assert G.gemv_config(1, 1024, 2048).split_k == 2
    # Qwen3-30B-A3B o_proj (N 2048, K 4096): 512 programs, 3.9 per SM: unsplit, no reduce launch
    # (W2 on an H100: 3.01 ms/token against 3.04 split in two)
    assert G.gemv_config(1, 2048, 4096).split_k == 1
    assert G.gemv_config(4, 128256, 4096).split_k == 1
    assert G.gemv_config(1, 128256, 4096).split_k == 1  # an LM head: no split (measured slower in W2)
    # Qwen3-30B-A3B qkv (N 5120, K 2048): the whole of K in one step (8.4 against 9.8 us in 4 on an
    # H100); Llama-3.1-8B's (K 4096) keeps 4 chunks of 256 a step
    assert str(G.gemv_config(1, 5120, 2048)) == "n16k256u8s1w8"
    assert str(G.gemv_config(1, 6144, 4096)) == "n16k256u4s1w8"
    for m, n, k in [(1, 4096, 4096), (4, 1024, 3072), (2, 28672, 4096)]:
        cfg = G.gemv_config(m, n, k)
        assert cfg.block_n % cfg.num_warps == 0 and cfg.split_k >= 1
    w = torch.empty(8, 16, dtype=torch.bfloat16)
    x = torch.empty(2, 16, dtype=torch.bfloat16)
    assert not G.use_gemv(x, w)  # CPU
    if CUDA:
        wc, xc = w.cuda(), x.cuda()
        assert G.use_gemv(xc[:1], wc) and not G.use_gemv(xc, wc), "M = 1 only: cuBLAS is as fast at 2"
        assert not G.use_gemv(torch.empty(5, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not G.use_gemv(xc.float(), wc.float())
        assert not G.use_gemv(xc, torch.empty(16, 8, dtype=torch.bfloat16, device="cuda").t())  # K-strided W


# --------------------------------------------------------------------------- float8 operands


def _fp8_operands(m, n, k, gen):
    """x and W rounded to float8 row by row (kernels.reference: quantization "fp8") and the
    fp32 product of what they stand for, sx[m] * sw[n] * sum_k q(x)[m, k] * q(W)[n, k]."""
    from kernels.reference import quantize_rows_fp8

    qx, sx = quantize_rows_fp8(torch.randn(m, k, generator=gen) * 3)
    qw, sw = quantize_rows_fp8(torch.randn(n, k, generator=gen) * k**-0.5)
    exact = F.linear(qx.float() * sx, qw.float() * sw)
    return qx.to(DEVICE), sx.to(DEVICE), qw.to(DEVICE), sw.view(-1).to(DEVICE), exact


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("cfg", ["default", "split3", "acc1d_split2"])
def test_float8_gemv_is_the_scaled_product_of_the_float8_operands(out_dtype, m, cfg):
    gen = torch.Generator().manual_seed(10 + m)
    qx, sx, qw, sw, exact = _fp8_operands(m, 37, 200, gen)
    out = G.gemv(qx, qw, CONFIGS[cfg], scales=(sx, sw), out_dtype=out_dtype)
    _close(out, exact.to(out_dtype).to(out.device), TOL[out_dtype])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", ["default", "small_tiles"])
def test_float8_gemv_glu_applies_both_row_scales_before_the_activation(out_dtype, cfg):
    from kernels import reference

    gen = torch.Generator().manual_seed(20)
    inter = 37
    qx, sx, qw, sw, exact = _fp8_operands(1, 2 * inter, 200, gen)
    out = G.gemv_glu(qx, qw, GLU_CONFIGS[cfg], scales=(sx, sw), out_dtype=out_dtype)
    want = reference.silu_and_mul(exact.to(out_dtype))  # the unfused path's roundings
    _close(out, want.to(out.device), 2 * TOL[out_dtype])


def test_float8_calls_must_name_their_scales_and_output_dtype():
    gen = torch.Generator().manual_seed(21)
    qx, sx, qw, sw, _ = _fp8_operands(1, 16, 32, gen)
    with pytest.raises(AssertionError, match="float8 x"):
        G.gemv(qx, qw)  # fp8 bytes read as values: wrong by the scales, so refused
    with pytest.raises(AssertionError, match="float8 x"):
        G.gemv(qx, qw, scales=(sx, sw))
    assert G.gemv_config(4, 1024, 4096, w_bytes=1).block_k == 512  # 16-byte loads of float8
    # at M = 1 the step per iteration follows the programs per SM (H200 measurements)
    assert str(G.gemv_config(1, 28672, 4096, w_bytes=1)) == "n16k256u2s1w8"
    assert str(G.gemv_config(1, 6144, 4096, w_bytes=1)) == "n16k512u4s1w8"
    assert str(G.gemv_config(1, 4096, 4096, w_bytes=1)) == "n16k512u8s1w8"
    assert str(G.gemv_config(1, 4096, 14336, w_bytes=1)) == "n16k1024u2s1w8"


# --------------------------------------------------------------------------- GPU, model sizes

# (N, K): Llama-3.1-8B o, qkv, gate_up, down, lm_head; Qwen3-0.6B qkv, gate_up, o, down
CUDA_SHAPES = [
    (4096, 4096),
    (6144, 4096),
    (28672, 4096),
    (4096, 14336),
    (128256, 4096),
    (4096, 1024),
    (6144, 1024),
    (1024, 2048),
    (1024, 3072),
]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("n,k", CUDA_SHAPES, ids=[f"{n}x{k}" for n, k in CUDA_SHAPES])
def test_cuda_gemv_large(n, k):
    gen = torch.Generator().manual_seed(0)
    w = _rand(n, k, dtype=torch.bfloat16, gen=gen, scale=k**-0.5)
    for m in (1, 2, 3, 4):
        x = _rand(m, k, dtype=torch.bfloat16, gen=gen)
        ref = F.linear(x.float(), w.float())  # exact-ish; both bf16 results are within an ulp of it
        out = G.gemv(x, w)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2**-7)
        _close(out, F.linear(x, w), 2**-6)
        xh, wh = x.half(), w.half()
        torch.testing.assert_close(G.gemv(xh, wh).float(), ref, atol=2e-2, rtol=2**-9)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("n,k", [(28672, 4096), (6144, 1024)], ids=["llama_gate_up", "qwen06_gate_up"])
def test_cuda_gemv_glu_large(n, k):
    from kernels import activation

    gen = torch.Generator().manual_seed(5)
    w = _rand(n, k, dtype=torch.bfloat16, gen=gen, scale=2 * k**-0.5)
    x = _rand(1, k, dtype=torch.bfloat16, gen=gen)
    out = G.gemv_glu(x, w)
    # the unfused engine path (cuBLAS, then the activation kernel), and an fp32 reference
    _close(out, activation.silu_and_mul(F.linear(x, w)), 2**-5)
    torch.testing.assert_close(out.float(), glu(x.float(), w.float()), atol=4e-2, rtol=2**-6)


@pytest.mark.cuda
@cuda
def test_cuda_gemv_graph_capture_replay():
    """gemv (split-K and not) and gemv_glu capture in a CUDA graph and replay with new inputs."""
    gen = torch.Generator().manual_seed(2)
    w = _rand(1024, 3072, dtype=torch.bfloat16, gen=gen, scale=3072**-0.5)
    x = _rand(2, 3072, dtype=torch.bfloat16, gen=gen)
    w2 = _rand(4096, 4096, dtype=torch.bfloat16, gen=gen, scale=4096**-0.5)
    x2 = _rand(3, 4096, dtype=torch.bfloat16, gen=gen)
    assert G.gemv_config(2, 1024, 3072).split_k > 1  # the two-pass path is in the graph
    calls = lambda: (G.gemv(x, w), G.gemv(x2, w2), G.gemv_glu(x2[:1], w2))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile outside the capture
            calls()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = calls()
    for _ in range(2):
        for t in (x, x2):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        g.replay()
        torch.cuda.synchronize()
        _close(outs[0], F.linear(x, w), 2**-6)
        _close(outs[1], F.linear(x2, w2), 2**-6)
        _close(outs[2], glu(x2[:1], w2), 2**-5)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096)], ids=["qkv", "down", "gate_up"])
def test_cuda_float8_gemv_matches_the_float8_gemm(n, k):
    """At Llama-3.1-8B's shapes the float8 GEMV (batch 1) gives what cuBLAS's float8 GEMM
    (every larger batch) gives for the same operands, within an ulp of bf16."""
    from kernels import activation
    from streamer.model import quant

    gen = torch.Generator().manual_seed(7)
    w = _rand(n, k, dtype=torch.bfloat16, gen=gen, scale=2 * k**-0.5)
    qw, sw = quant.quantize_rows_fp8(w)
    sw = sw.view(-1)
    x = _rand(1, k, dtype=torch.bfloat16, gen=gen)
    gemm = quant.fp8_linear(x, qw, sw, None)
    _close(quant.fp8_gemv(x, qw, sw), gemm, 2**-6)
    _close(quant.fp8_gemv_glu(x, qw, sw), activation.silu_and_mul(gemm), 2**-5)
    assert G.use_gemv(x, qw) and not G.use_gemv(x.expand(2, k), qw) and not G.use_gemv(x.float(), qw)


# ---------------------------------------------------------------- rows as decode (speculation's verify)


@pytest.mark.parametrize("m", [2, 5, 9])
@pytest.mark.parametrize("n,k", [(37, 2048), (40, 200), pytest.param(4096, 2048, marks=cuda)],
                         ids=["split_k", "ragged_k", "m1_config"])  # (m1_config: minutes in the interpreter)
def test_per_row_gemv_gives_each_row_the_bits_of_a_lone_row(m, n, k):
    """A verify step's rows through gemv(per_row=True) equal the one-row decode GEMV of each row
    bit for bit: the same config (M = 1's, split-K included) and one row per program. At
    N = 4096, M = 1 has a config of its own (16-row tiles, 8 warps): on the GPU, without
    per_row, those rows would be reduced over another thread layout."""
    if n == 4096:
        assert G.gemv_config(1, n, k) != G.gemv_config(m, n, k)
    gen = torch.Generator().manual_seed(m + n)
    x = _rand(m, k, dtype=torch.bfloat16, gen=gen)
    w = _rand(n, k, dtype=torch.bfloat16, gen=gen, scale=k**-0.5)
    rows = G.gemv(x, w, per_row=True)
    for i in range(m):
        assert torch.equal(rows[i], G.gemv(x[i : i + 1], w)[0]), i
    _close(rows, linear(x, w), TOL[torch.bfloat16])


def test_per_row_programs_take_the_rows_their_registers_hold():
    """ptxas -v on sm_90a: bf16 chunks and small float8 ones hold 4 rows without spilling,
    larger float8 chunks 2 or 1 (kernels/gemv/config.py rows_per_program)."""
    cfg = G.GemvConfig
    assert G.rows_per_program(G.gemv_config(1, 4096, 4096)) == 4
    assert G.rows_per_program(cfg(block_k=256, unroll=2)) == 4
    assert G.rows_per_program(cfg(block_k=512, unroll=4)) == 2
    assert G.rows_per_program(cfg(block_k=512, unroll=8)) == 1
    assert G.rows_per_program(cfg(block_k=1024, unroll=2)) == 1


@pytest.mark.parametrize("m", [3, 5])
@pytest.mark.parametrize("block_k,unroll", [(512, 4), (1024, 2)], ids=["two_per_program", "one_per_program"])
def test_per_row_float8_gemv_gives_each_row_the_bits_of_a_lone_row(m, block_k, unroll):
    from streamer.model import quant

    gen = torch.Generator().manual_seed(m)
    n, k = 24, 4096
    x = _rand(m, k, dtype=torch.bfloat16, gen=gen)
    w, sw = quant.quantize_rows_fp8(_rand(n, k, dtype=torch.bfloat16, gen=gen, scale=k**-0.5))
    qx, sx = quant.quantize_rows_fp8(x)
    cfg = G.GemvConfig(block_n=16, block_k=block_k, unroll=unroll, num_warps=8)
    scales = (sx.view(-1), sw.view(-1))
    rows = G.gemv(qx, w, cfg, scales=scales, out_dtype=torch.bfloat16, per_row=True)
    for i in range(m):
        alone = G.gemv(qx[i : i + 1], w, cfg, scales=(sx.view(-1)[i : i + 1], sw.view(-1)), out_dtype=torch.bfloat16)
        assert torch.equal(rows[i], alone[0]), i


@pytest.mark.parametrize("m", [1, 3, 9])
def test_gemv_glu_of_several_rows_gives_each_the_bits_of_a_lone_row(m):
    gen = torch.Generator().manual_seed(m)
    k, inter = 200, 37
    x = _rand(m, k, dtype=torch.bfloat16, gen=gen)
    w = _rand(2 * inter, k, dtype=torch.bfloat16, gen=gen, scale=2 * k**-0.5)
    rows = G.gemv_glu(x, w)
    assert rows.shape == (m, inter)
    for i in range(m):
        assert torch.equal(rows[i], G.gemv_glu(x[i], w)), i
    _close(rows, glu(x, w), 2 * TOL[torch.bfloat16])


def test_float8_gemv_glu_of_several_rows_takes_each_rows_scale():
    from streamer.model import quant

    gen = torch.Generator().manual_seed(5)
    k, inter = 256, 24
    x = _rand(4, k, dtype=torch.bfloat16, gen=gen) * torch.tensor([[1.0], [10.0], [0.1], [3.0]], device=DEVICE)
    w, sw = quant.quantize_rows_fp8(_rand(2 * inter, k, dtype=torch.bfloat16, gen=gen, scale=k**-0.5))
    rows = quant.fp8_gemv_glu(x.to(torch.bfloat16), w, sw.view(-1))
    for i in range(4):
        assert torch.equal(rows[i], quant.fp8_gemv_glu(x[i : i + 1].to(torch.bfloat16), w, sw.view(-1))[0]), i


def test_weights_are_prefetched_only_where_the_kernel_may_start_early():
    """prefetch_lines: the 128-byte lines of each weight row a GEMV program asks L2 for before its
    PDL wait. None without PDL (the kernel's loads then start at once); else a power of two, at
    least one line, at most PREFETCH_BYTES of the row and no more than the row holds."""
    from kernels.common import PREFETCH_BYTES, prefetch_lines

    assert prefetch_lines(8192, pdl=False) == 0
    assert prefetch_lines(0, pdl=True) == 0
    assert prefetch_lines(8192, pdl=True) == PREFETCH_BYTES // 128
    assert prefetch_lines(512, pdl=True) == 4  # (a split-K share shorter than the cap)
    assert prefetch_lines(300, pdl=True) == 4  # (the row's tail line: the kernel clamps to the row)
    assert prefetch_lines(64, pdl=True) == 1


def test_the_engine_can_turn_the_prefetch_off(monkeypatch):
    """PREFETCH_BYTES = 0 (STREAMER_L2_PREFETCH=0, set by the model runner): no lines at all."""
    from kernels import common

    monkeypatch.setattr(common, "PREFETCH_BYTES", 0)
    assert common.prefetch_lines(8192, pdl=True) == 0
