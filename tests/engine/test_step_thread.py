"""On the CPU an engine builds its model on the thread that runs every step of it, and
closing the engine ends that thread (engine/step_thread.py: torch's OpenMP teams belong to
threads, and a second team slowed every op of a step ~2x on two cores)."""

from __future__ import annotations

import threading

from streamer import LLM, SamplingParams
from streamer.model.runner import ModelRunner


def test_the_model_is_built_and_stepped_on_one_thread_that_close_ends(tiny_models, monkeypatch):
    threads: dict[str, set[int]] = {"init": set(), "launch": set()}
    init, launch = ModelRunner.__init__, ModelRunner.launch

    def recording_init(self, *args, **kwargs):
        threads["init"].add(threading.get_ident())
        init(self, *args, **kwargs)

    def recording_launch(self, batch):
        threads["launch"].add(threading.get_ident())
        return launch(self, batch)

    monkeypatch.setattr(ModelRunner, "__init__", recording_init)
    monkeypatch.setattr(ModelRunner, "launch", recording_launch)
    llm = LLM(str(tiny_models["qwen2"]))
    llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=4, temperature=0))
    assert threads["init"] == threads["launch"] and len(threads["init"]) == 1
    assert threads["init"] != {threading.get_ident()}  # (not the caller's)
    alive = [t for t in threading.enumerate() if t.ident in threads["init"]]
    assert len(alive) == 1
    llm.close()
    alive[0].join(timeout=5)
    assert not alive[0].is_alive()
