"""A Scheduler over a small CPU pool, and fake step outputs to drive it (every sampled
token is 7)."""

from __future__ import annotations

import torch

from streamer.config import EngineConfig
from streamer.engine.scheduler import Scheduler
from streamer.kv.pages import PagePool
from streamer.messages import SampledToken, SamplingParams, StepOutput, TokenizedRequest


def scheduler(num_pages: int = 256, page_size: int = 16, kv_window: int = 0, **kw) -> Scheduler:
    pool = PagePool(1, num_pages, page_size, 1, 4, torch.float32, "cpu")
    return Scheduler(EngineConfig(num_pages=num_pages, **kw), pool, max_model_len=4096, kv_window=kv_window)


def submit(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    assert s.add(TokenizedRequest(request_id=rid, prompt_token_ids=prompt, params=params, eos_token_ids=[2])) is None


def finish_step(s: Scheduler, batch) -> None:
    s.process(batch, StepOutput(batch.step, [SampledToken(7) for c in batch.seqs if c.sample]))


def run_to_end(s: Scheduler) -> dict[str, list]:
    """Step the scheduler (fake tokens) until nothing is left; each request's deltas."""
    deltas: dict[str, list] = {}
    while (batch := s.schedule()) is not None:
        for d in s.process(batch, StepOutput(batch.step, [SampledToken(7) for c in batch.seqs if c.sample])):
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def salted(s: Scheduler, rid: str, prompt: list[int], salt: str | None, **kw) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, cache_salt=salt, **kw)
    assert s.add(TokenizedRequest(request_id=rid, prompt_token_ids=prompt, params=params, eos_token_ids=[2])) is None
