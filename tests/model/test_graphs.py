"""The padding rules that make one captured CUDA graph serve many batches (checked on
the CPU: they are host arithmetic; the graphs themselves run in tests/gpu)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import extend_tiles
from streamer.model.graphs import DecodeGraphs, ExtendGraphs, ladder, token_ladder


def test_token_ladder_is_aligned_ends_at_the_limit_and_pads_little():
    for limit in (100, 2048, 8192):
        sizes = token_ladder(limit)
        assert sizes[-1] == limit and sizes == sorted(set(sizes))
        assert all(s % 16 == 0 for s in sizes[:-1])
        # a step is padded by less than 16 tokens or 1/12 of its own
        for t in range(1, limit + 1, 7):
            pad = next(s for s in sizes if s >= t)
            assert pad - t < max(16, t / 12), (limit, t, pad)


def test_decode_ladder_covers_every_batch_size():
    sizes = ladder(256)
    assert sizes[0] == 1 and sizes[-1] == 256
    assert all(any(s >= b for s in sizes) for b in range(1, 257))


def test_decode_ladder_pads_large_batches_by_about_3_percent():
    # above 256 rows the GEMMs are compute-bound: a padded row costs a real row's work
    sizes = ladder(4096)
    assert sizes == sorted(set(sizes))
    for b in range(257, 4097):
        assert next(s for s in sizes if s >= b) - b < max(8, b / 32), b
    for max_bs in (1, 3, 100, 500, 4000):
        assert ladder(max_bs)[-1] == max_bs  # the largest batch allowed has a graph


def small_extend_graphs(max_tokens: int, max_seqs: int, block_m: int) -> ExtendGraphs:
    cache = torch.zeros(1, 2, 4, 1, 8)  # [layers, pages, page_size, kv_heads, head_dim]
    return ExtendGraphs(None, cache, cache, max_tokens, max_seqs, max_pages=4, block_m=block_m)


@settings(max_examples=300, deadline=None)
@given(
    q_lens=st.lists(st.integers(0, 300), min_size=1, max_size=40),
    block_m=st.sampled_from([16, 32, 64]),
)
def test_any_batch_that_fits_has_a_tile_list_within_its_graphs_grid(q_lens, block_m):
    """A graph launches num_tiles(padded(T)) programs per head: every batch it accepts must
    list no more tiles than that, or some queries would never be computed."""
    eg = small_extend_graphs(max_tokens=2048, max_seqs=32, block_m=block_m)
    total = sum(q_lens)
    if not eg.fits(total, len(q_lens), width=4) or total == 0:
        return
    tiles = extend_tiles(q_lens, block_m, pad_to=eg.num_tiles(eg.padded(total)))
    assert len(tiles) == eg.num_tiles(eg.padded(total))
    live = tiles[tiles >= 0]
    # each sequence's query blocks, once each, in order
    want = [(b << 16) | m for b, n in enumerate(q_lens) for m in range(-(-n // block_m))]
    assert live.tolist() == want


def test_fits_rejects_what_the_static_buffers_cannot_hold():
    eg = small_extend_graphs(max_tokens=512, max_seqs=8, block_m=64)
    assert eg.fits(512, 8, 4)
    assert not eg.fits(513, 8, 4)
    assert not eg.fits(100, 9, 4)
    assert not eg.fits(100, 8, 5)


def test_capture_ladder_records_largest_first_into_one_memory_pool(monkeypatch):
    """The capture order (largest first, so smaller graphs fit in its pool) and the pool
    handed from graph to graph, with CUDA's graph API stood in for on the CPU."""
    from streamer.model import graphs

    captures = fake_capture(monkeypatch, "pool-of-the-first")
    calls: list[int] = []

    def run(n):
        calls.append(n)
        return torch.full((n,), n)

    got, outputs, pool = graphs.capture_ladder([1, 2, 4], run, None)
    assert calls == [4, 4, 2, 2, 1, 1]  # a warm-up run, then the captured one
    assert [p for p, _ in captures] == [None, "pool-of-the-first", "pool-of-the-first"] and pool == "pool-of-the-first"
    assert {mode for _, mode in captures} == {"global"}  # (at start: no other thread's CUDA call is allowed)
    assert sorted(got) == [1, 2, 4] and all(outputs[n].tolist() == [n] * n for n in (1, 2, 4))
    _, _, shared = graphs.capture_ladder([8], run, "decode-pool")
    assert captures[-1][0] == "decode-pool" and shared == "decode-pool"


class RecordingModel:
    """Stands in for a model: records the step context of each run (its slots and LoRA ids)."""

    graph_outputs = ()

    def __init__(self) -> None:
        self.runs: list[tuple[list[int], list[int] | None]] = []

    def __call__(self, input_ids, positions):
        from streamer.model.context import get_context

        ctx = get_context()
        ids = None if ctx.lora_ids is None else ctx.lora_ids.tolist()
        self.runs.append((ctx.slot_mapping.tolist(), ids))
        return torch.zeros(len(input_ids), 4)

    def compute_logits(self, hidden):
        return hidden


def fake_capture(monkeypatch, first_pool: str = "pool") -> list[tuple[object, str]]:
    """CUDA's graph API stood in for on the CPU (a replay does nothing; a graph's pool is first_pool);
    returns each capture's (pool given, capture_error_mode), as they happen."""
    import contextlib

    captures: list[tuple[object, str]] = []

    class FakeGraph:
        def pool(self):
            return first_pool

        def replay(self):
            pass

    @contextlib.contextmanager
    def fake_graph(g, pool=None, capture_error_mode="global"):
        captures.append((pool, capture_error_mode))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return captures


def lora_step(b: int, slots: list[int], ids: list[int]) -> dict:
    return {"input_ids": torch.ones(b, dtype=torch.long), "positions": torch.zeros(b, dtype=torch.long),
            "slot_mapping": torch.tensor(slots), "page_table": torch.ones(b, 2, dtype=torch.int32),
            "seq_lens": torch.full((b,), 5, dtype=torch.int32), "lora_ids": torch.tensor(ids)}


def test_lora_decode_graphs_capture_each_size_when_first_needed_with_the_adapters_ids(monkeypatch):
    """LoRA graphs (DecodeGraphs loras): a size is captured at its first replay, as a serving-time
    capture (another thread's CUDA calls are not its errors), from reset inputs: the warm-up run
    writes no K/V (slot -1) though an earlier step's slots were in the static buffers. The
    captured runs read each row's adapter from the static lora_ids, whose padding rows are the
    base model's (0)."""
    captures = fake_capture(monkeypatch)
    cache = torch.zeros(1, 2, 4, 1, 8)
    model = RecordingModel()
    g = DecodeGraphs(model, cache, cache, max_bs=8, max_pages=2, loras=True, pool="decode-pool")
    assert g.graphs == {} and g.fits(8, 2)
    g.replay(lora_step(3, [9, 10, 11], [1, 2, 0]))
    assert sorted(g.graphs) == [4] and captures == [("decode-pool", "thread_local")] and g.pool == "decode-pool"
    assert [slots for slots, _ in model.runs] == [[-1] * 4] * 2  # (warm-up and capture)
    assert all(ids == [0, 0, 0, 0] for _, ids in model.runs)  # (the buffer, as captured)
    assert g.lora_ids[:4].tolist() == [1, 2, 0, 0] and g.slot_mapping[:4].tolist() == [9, 10, 11, -1]
    g.replay(lora_step(4, [1, 2, 3, 4], [2, 2, 1, 1]))  # (replayed: no second capture)
    assert len(model.runs) == 2 and g.lora_ids[:4].tolist() == [2, 2, 1, 1]
    g.replay(lora_step(2, [5, 6], [1, 1]))  # (a new size: its inputs reset before its warm-up)
    assert sorted(g.graphs) == [2, 4] and model.runs[2:] == [([-1, -1], [0, 0])] * 2
    base = DecodeGraphs(RecordingModel(), cache, cache, max_bs=8, max_pages=2)
    assert not base.loras and base.lora_ids.numel() == 0


def test_lora_extend_graphs_capture_each_token_count_when_first_needed(monkeypatch):
    """ExtendGraphs loras: as the decode ones, a padded token count is captured at its first
    replay from reset inputs (no sequence, no tile: the warm-up writes and reads nothing), and
    each token's adapter is copied into lora_ids, the padding tokens' 0."""
    captures = fake_capture(monkeypatch)
    cache = torch.zeros(1, 2, 4, 1, 8)
    model = RecordingModel()
    eg = ExtendGraphs(model, cache, cache, 64, 4, max_pages=2, block_m=16, pool="decode-pool", loras=True)
    eg.slot_mapping[:3] = torch.tensor([7, 8, 9])  # (an earlier step's)
    eg.tiles[:2] = 0
    x = {**lora_step(3, [4, 5, 6], [1, 1, 2]), "page_table": torch.ones(2, 2, dtype=torch.int32),
         "seq_lens": torch.tensor([5, 4], dtype=torch.int32), "cu_q_lens": torch.tensor([0, 2, 3], dtype=torch.int32),
         "tiles": torch.zeros(eg.num_tiles(16), dtype=torch.int32)}
    eg.replay(x)
    assert sorted(eg.graphs) == [16] and captures == [("decode-pool", "thread_local")]
    assert [slots for slots, _ in model.runs] == [[-1] * 16] * 2 and all(ids == [0] * 16 for _, ids in model.runs)
    assert eg.lora_ids[:4].tolist() == [1, 1, 2, 0] and eg.lora_ids[3:16].sum() == 0
    eg.replay(x)
    assert len(model.runs) == 2


def test_an_eager_decode_splits_keys_for_the_graphs_width(tiny_models, monkeypatch):
    """Decode attention's split count comes from the longest context it is chosen for: a graph
    replay's is its table's width (pages of max_model_len), so an eager step gives the same
    (ForwardContext.max_seq_len), not its own batch's width: a sequence's keys are then
    divided alike, and its bits are the graph's (tests/gpu: graphs against eager)."""
    from kernels import ops
    from streamer import LLM, SamplingParams

    seen: list[tuple[int, int | None]] = []
    real = ops.paged_attention

    def spy(*args, **kwargs):
        seen.append((args[7], kwargs.get("max_seq_len")))  # (max_q_len, max_seq_len)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "paged_attention", spy)
    with LLM(str(tiny_models["llama3"]), max_model_len=200, page_size=16) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    decode = {s for q, s in seen if q == 1}
    assert decode == {13 * 16}  # 200 tokens in pages of 16, not the 1-page table of a 4-token context
