"""LoRA adapters loaded and unloaded while the engine serves (engine/adapters.py): an adapter
loaded at runtime gives the merged model's greedy output (transformers, float32, CPU) beside the
base model's requests; unloaded, its name is refused and its running requests end with an error
naming it; a name loaded anew is another adapter, whose prefixes are not the old one's; what the
engine cannot do is refused by name and changes nothing."""

from __future__ import annotations

import asyncio

import pytest

from streamer import LLM, SamplingParams
from streamer.engine.engine import AsyncEngine
from streamer.errors import LoraNotFound, ModelLoadError, RequestError
from streamer.messages import GenerateRequest
from tests.model.lora_files import make_adapter, merged
from tests.model.test_greedy_vs_transformers import prompts
from tests.model.test_lora import ALL
from tests.oracle import Comparison, compare


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runtime")
    base = tiny_models["qwen3"]
    adapters = {"one": make_adapter(root / "one", base, ALL, rank=4, alpha=8, seed=1),
                "two": make_adapter(root / "two", base, ["q_proj", "v_proj"], rank=2, alpha=4, seed=2)}
    return base, adapters, {name: merged(root / f"{name}-merged", base, path) for name, path in adapters.items()}


def greedy(lora=None, n=10):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lora=lora)


def test_an_adapter_loaded_while_serving_runs_beside_the_base_model_and_goes_away(setup):
    base, adapters, oracles = setup
    with LLM(str(base), allow_runtime_lora_updating=True) as llm:
        batch = prompts(llm.tokenizer, 2, 5, 40)
        assert llm.generate(batch[:1], greedy("one"))[0].error is not None  # (not loaded yet)
        llm.load_lora("one", str(adapters["one"]))
        assert llm.engine.info.loras == ("one",)
        outs = llm.generate(batch * 2, [greedy("one")] * 2 + [greedy()] * 2)
        cmp = Comparison()
        for p, out, oracle in zip(batch * 2, outs, [oracles["one"]] * 2 + [base] * 2):
            assert out.error is None, out.error
            compare(oracle, p, out.token_ids, cmp)
        assert not cmp.failures, "\n".join(cmp.failures)
        assert llm.generate(batch[1:], greedy("one"))[0].cached_tokens > 0  # (its prefixes are cached)

        llm.unload_lora("one")
        assert llm.engine.info.loras == ()
        gone = llm.generate(batch[:1], greedy("one"))[0]
        assert gone.finish_reason == "error" and "no LoRA adapter is named 'one'" in gone.error
        # the name again, another adapter: its output is the other merged model's, none of the old prefixes
        llm.load_lora("one", str(adapters["two"]))
        again = llm.generate(batch[1:], greedy("one"))[0]
        assert again.cached_tokens == 0
        cmp = Comparison()
        compare(oracles["two"], batch[1], again.token_ids, cmp)
        assert not cmp.failures, "\n".join(cmp.failures)
        llm.check()


def test_load_inplace_replaces_an_adapter_and_ends_the_old_ones_requests(setup):
    base, adapters, oracles = setup

    async def main():
        engine = AsyncEngine(model=str(base), allow_runtime_lora_updating=True,
                             lora_modules=(f"one={adapters['one']}",))
        await engine.start()
        try:
            prompt = prompts(engine.hf_tokenizer, 1, 20, 20)[0]
            running = engine.submit(GenerateRequest(request_id="long", prompt_token_ids=prompt,
                                                    params=greedy("one", n=400)))
            first = await anext(running)  # (it runs: its first tokens are out)
            assert not first.finished
            with pytest.raises(RequestError, match="loaded already"):
                await engine.load_lora("one", str(adapters["two"]))
            await engine.load_lora("one", str(adapters["two"]), replace=True)
            rest = [out async for out in running]
            last = rest[-1] if rest else first
            assert last.finished and last.finish_reason == "error" and "'one' was unloaded" in last.error
            assert len(last.token_ids) < 400
            out = await engine.generate(GenerateRequest(request_id="new", prompt_token_ids=prompt,
                                                        params=greedy("one")))
            assert out.error is None and engine.info.loras == ("one",)
            return prompt, out.token_ids
        finally:
            await engine.stop()

    prompt, ids = asyncio.run(main())
    cmp = Comparison()
    compare(oracles["two"], prompt, ids, cmp)
    assert not cmp.failures, "\n".join(cmp.failures)


def test_what_cannot_be_loaded_or_unloaded_is_refused_by_name_and_changes_nothing(setup, tmp_path):
    base, adapters, _ = setup
    with LLM(str(base)) as llm:  # (not allowed)
        with pytest.raises(RequestError, match="allow-runtime-lora-updating"):
            llm.load_lora("one", str(adapters["one"]))
        with pytest.raises(RequestError, match="allow-runtime-lora-updating"):
            llm.unload_lora("one")
    with LLM(str(base), allow_runtime_lora_updating=True) as llm:
        with pytest.raises(ModelLoadError, match="adapter_config.json"):
            llm.load_lora("one", str(tmp_path))
        bad = make_adapter(tmp_path / "bad", base, ["q_proj"], rank=2, alpha=2, seed=3, extra={"use_dora": True})
        with pytest.raises(ModelLoadError, match="DoRA"):
            llm.load_lora("bad", str(bad))
        with pytest.raises(LoraNotFound, match="'one'.*none is loaded"):
            llm.unload_lora("one")
        with pytest.raises(RequestError, match="served model"):
            llm.load_lora(llm.engine.info.name, str(adapters["one"]))
        with pytest.raises(RequestError, match="lora_name"):
            llm.load_lora(" one", str(adapters["one"]))
        assert llm.engine.info.loras == ()
        assert llm.generate([[5, 6, 7]], greedy(n=2))[0].error is None
