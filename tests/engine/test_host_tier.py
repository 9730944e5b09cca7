"""The host KV tier end to end (tiny random Llama, CPU): sessions whose histories outgrow the
device pool keep their prefix hits through the host, and greedy output does not change."""

from __future__ import annotations

import random

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.kv.pages import PagePool

SESSIONS, TURNS, NEW, OUT, PS = 16, 6, 12, 4, 16


def chat(llm: LLM) -> tuple[list[list[int]], int, int, int]:
    """Round-robin sessions, one turn at a time: outputs, cached, host-cached, prompt tokens."""
    rng = random.Random(0)
    history = {i: [rng.randrange(10, 40000) for _ in range(5)] for i in range(SESSIONS)}
    outs, cached, host, prompt = [], 0, 0, 0
    params = SamplingParams(max_tokens=OUT, temperature=0, ignore_eos=True)
    for _ in range(TURNS):
        for i in range(SESSIONS):
            p = history[i] + [rng.randrange(10, 40000) for _ in range(NEW)]
            (o,) = llm.generate([p], params)
            outs.append(o.token_ids)
            cached, host, prompt = cached + o.cached_tokens, host + o.cached_host_tokens, prompt + o.prompt_tokens
            assert o.cached_host_tokens <= o.cached_tokens
            history[i] = p + o.token_ids
    llm.check()
    return outs, cached, host, prompt


@pytest.fixture(scope="module")
def llama(tiny_models):
    return str(tiny_models["llama3"])


def test_sessions_outgrowing_the_pool_hit_the_host_and_keep_greedy_output(llama):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(llama)
    page = PagePool.bytes_per_page(cfg.num_hidden_layers, PS, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    working = SESSIONS * ((5 + TURNS * (NEW + OUT)) // PS + 1)
    small = dict(page_size=PS, num_pages=working // 4, max_num_seqs=4)
    with LLM(llama, page_size=PS, num_pages=4 * working) as big:
        want, optimal, _, _ = chat(big)
    with LLM(llama, **small) as plain:
        _, forgot, _, _ = chat(plain)
    with LLM(llama, **small, host_kv_cache_gb=2 * working * page / (1 << 30)) as tiered:
        got, cached, host, prompt = chat(tiered)
        s = tiered.stats()
    assert got == want, "greedy output is the same whether the prefix came from the device, the host or nowhere"
    assert forgot < 0.1 * optimal
    assert cached >= 0.9 * optimal, (cached, optimal)
    assert host >= 0.5 * cached
    assert s.host is not None and s.host.write_backs > 0 and s.host.load_backs > 0
    assert s.host.cached_tokens_total == host and abs(s.host.hit_rate - host / prompt) < 1e-9


def test_a_host_tier_needs_the_prefix_cache_and_room_for_a_page(llama):
    from streamer.errors import ConfigError

    with pytest.raises(ConfigError, match="host_kv_cache_gb"):
        LLM(llama, host_kv_cache_gb=1, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="holds no KV page"):
        LLM(llama, host_kv_cache_gb=1e-9)
