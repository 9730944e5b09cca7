"""Closing an LLM releases the device memory it holds at once, not at garbage collection:
the model, the draft model and every KV pool tensor (also the byte views the host tier and
the draft use), so that a second engine started in the same process finds the memory free."""

from __future__ import annotations

import gc
import weakref

from streamer import LLM, SamplingParams


def test_close_drops_the_model_the_draft_and_the_kv_pools(tiny_models):
    path = str(tiny_models["qwen2"])
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    llm = LLM(path, speculative_config=spec)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0))
    runner = llm.engine.runner
    pools = [runner.pool, runner.draft.pool]
    models = [weakref.ref(runner.model), weakref.ref(runner.draft.model)]
    assert all(p.k.numel() and p.k_bytes.numel() for p in pools)
    llm.close()
    gc.collect()  # (modules hold reference cycles of their own; nothing outside may hold them)
    assert all(m() is None for m in models), "the model and the draft are gone"
    for p in pools:  # (the scheduler's pages still reference the pool object: its tensors are emptied)
        assert p.k.numel() == p.v.numel() == p.k_bytes.numel() == p.v_bytes.numel() == 0
