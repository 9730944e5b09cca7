"""STREAMER_PROFILE_STEPS: the steps it names run under the profiler, one JSON line each
with the step's shape and its kernels (on CPU: torch operators) by time; other steps run
as before and the generated tokens do not change."""

from __future__ import annotations

import json

from streamer import LLM
from streamer.messages import SamplingParams


def test_named_steps_are_profiled_and_tokens_unchanged(tiny_models, tmp_path, monkeypatch):
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=64, max_num_seqs=4, warmup=False)
    with LLM(str(tiny_models["llama3"]), **kw) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, sp)]

    out = tmp_path / "kernels.jsonl"
    monkeypatch.setenv("STREAMER_PROFILE_STEPS", "1,3")
    monkeypatch.setenv("STREAMER_PROFILE_OUT", str(out))
    with LLM(str(tiny_models["llama3"]), **kw) as llm:
        profiled = [o.token_ids for o in llm.generate(prompts, sp)]

    assert profiled == plain
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 3]
    first, later = recs
    assert (first["seqs"], first["tokens"], first["decodes"]) == (2, 8, 0)  # both prompts
    assert (later["seqs"], later["tokens"], later["decodes"]) == (2, 2, 2)  # a decode step
    for r in recs:
        names = [k[0] for k in r["kernels"]]
        assert any("mm" in n or "linear" in n for n in names), names
        assert r["total_us"] > 0 and abs(sum(k[2] for k in r["kernels"]) - r["total_us"]) < 1 + 1e-3 * r["total_us"]
        assert all(len(k) == 4 and k[3] >= 0 for k in r["kernels"])
