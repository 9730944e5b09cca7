"""LoRA adapters (model/lora.py): requests of the base model and of two adapters batched in one
engine give, each, transformers' greedy output of the model with that adapter merged into its
weights (float32, CPU), also chunked; an adapter's prefixes are cached apart from the base
model's; what an adapter folder or a config cannot be is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.config import ConfigError, EngineConfig
from streamer.errors import ModelLoadError
from tests.conftest import make_tiny_model
from tests.model.lora_files import make_adapter, merged
from tests.model.test_greedy_vs_transformers import prompts
from tests.oracle import Comparison, compare

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=["llama3", "qwen3", "cohere"])
def family(request, tiny_models, default_model, tmp_path_factory) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """(base folder, adapter folders, merged folders) of "one" (every layer, rank 4) and "two"
    (q and v only, rank 2, rsLoRA's scale). Cohere's interleaved rotary reorders q/k rows after
    loading (model/llama.py rotary_permutation): the adapters' B rows must follow."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = tiny_models.get(request.param) or make_tiny_model(
        root / "base", "CohereForCausalLM", default_model, logit_scale=0.25, pad_token_id=None)
    adapters = {"one": make_adapter(root / "one", base, ALL, rank=4, alpha=8, seed=1),
                "two": make_adapter(root / "two", base, ["q_proj", "v_proj"], rank=2, alpha=4, seed=2, rslora=True)}
    return base, adapters, {name: merged(root / f"{name}-merged", base, path) for name, path in adapters.items()}


def modules(adapters: dict[str, Path]) -> tuple[str, ...]:
    return tuple(f"{name}={path}" for name, path in adapters.items())


@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole", "chunked"])
def test_base_and_adapters_batched_give_each_ones_merged_model_output(family, chunk):
    base, adapters, oracles = family
    params = {name: SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, lora=name)
              for name in (None, "one", "two")}
    with LLM(str(base), lora_modules=modules(adapters), max_num_batched_tokens=chunk) as llm:
        batch = prompts(llm.tokenizer, 3, 5, 40)
        asked = [(p, name) for p in batch for name in params]
        outs = llm.generate([p for p, _ in asked], [params[name] for _, name in asked])
        llm.check()
    cmp = Comparison()
    for (p, name), out in zip(asked, outs):
        assert out.error is None, out.error
        compare(base if name is None else oracles[name], p, out.token_ids, cmp)
    assert not cmp.failures, "\n".join(cmp.failures)
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1, "the adapters change the output"


def test_an_adapters_prefixes_are_cached_apart_from_the_base_models(family):
    base, adapters, _ = family
    with LLM(str(base), lora_modules=modules(adapters)) as llm:
        prompt = prompts(llm.tokenizer, 1, 40, 40)[0]
        one = SamplingParams(max_tokens=2, temperature=0, lora="one")
        first = llm.generate([prompt], one)[0]
        assert llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0].cached_tokens == 0
        assert llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, lora="two"))[0].cached_tokens == 0
        again = llm.generate([prompt], one)[0]
        assert again.cached_tokens > 0 and again.token_ids == first.token_ids
        unknown = llm.generate([prompt], SamplingParams(max_tokens=2, lora="three"))[0]
        assert unknown.error is not None and "three" in unknown.error and "one, two" in unknown.error


def test_a_server_without_adapters_refuses_a_requests_adapter(tiny_models):
    with LLM(str(tiny_models["qwen3"])) as llm:
        out = llm.generate(["Hi"], SamplingParams(max_tokens=2, lora="one"))[0]
        assert out.error is not None and "--lora-modules" in out.error


@pytest.mark.parametrize(("extra", "targets", "word"), [
    ({"use_dora": True}, ["q_proj"], "DoRA"),
    ({"bias": "all"}, ["q_proj"], "bias"),
    ({"modules_to_save": ["lm_head"]}, ["q_proj"], "modules_to_save"),
    ({"peft_type": "IA3"}, ["q_proj"], "IA3"),
    ({"lora_bias": True}, ["q_proj"], "lora_bias"),
    ({"layer_replication": [[0, 2]]}, ["q_proj"], "layer_replication"),
])
def test_what_an_adapter_cannot_be_is_refused_by_name(tiny_models, tmp_path, extra, targets, word):
    base = tiny_models["qwen3"]
    bad = make_adapter(tmp_path / "bad", base, targets, rank=2, alpha=2, seed=3, extra=extra)
    with pytest.raises(ModelLoadError, match=word):
        LLM(str(base), lora_modules=(f"bad={bad}",))


def test_an_adapter_of_a_layer_that_is_not_linear_is_refused(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    base = tiny_models["qwen3"]
    bad = make_adapter(tmp_path / "bad", base, ["q_proj"], rank=2, alpha=2, seed=3)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    tensors = {k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.q_norm"): v for k, v in tensors.items()}
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="q_norm"):
        LLM(str(base), lora_modules=(f"bad={bad}",))


@pytest.mark.parametrize(("kw", "word"), [
    ({"lora_modules": ("nopath",)}, "NAME=PATH"),
    ({"lora_modules": ("a=/x", "a=/y")}, "name of its own"),
])
def test_config_errors_name_the_option(kw, word):
    with pytest.raises(ConfigError, match=word):
        EngineConfig(**kw)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "draft_model", "num_speculative_tokens": 3},
], ids=["ngram", "draft_model"])
def test_speculative_decoding_keeps_each_requests_adapter(family, spec):
    """Verify chunks run with their request's adapter (the draft proposes with the base model: only
    the acceptance depends on it): greedy outputs equal those without speculation."""
    base, adapters, _ = family
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(base)}
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 50, (n,), generator=g).tolist() * 3 for n in (5, 12, 20)]  # (repeats: ngram finds them)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, lora=name) for name in ("one", None, "two")]
    with LLM(str(base), lora_modules=modules(adapters)) as llm:
        want = [o.token_ids for o in llm.generate(batch, params)]
    with LLM(str(base), lora_modules=modules(adapters), speculative_config=spec) as llm:
        outs = llm.generate(batch, params)
        verified = llm.stats().spec_draft_tokens
    assert [o.error for o in outs] == [None] * 3
    assert [o.token_ids for o in outs] == want
    if spec["method"] == "draft_model":  # (it always proposes; ngram, where the context repeats)
        assert verified > 0


def test_steps_with_an_adapters_tokens_take_the_lora_graphs_where_the_base_models_take_graphs():
    """model/packing.py: a decode step with an adapter's token replays the LoRA decode graphs
    (each row's adapter in lora_ids, 0 for the base model's), a prefill or mixed step the LoRA
    extend graphs; a step of the base model alone, its own graphs; a step that runs eagerly for
    the base model (prompt logprobs) does so with adapters too."""
    from streamer.messages import Batch, SeqChunk
    from streamer.model.graphs import DecodeGraphs, ExtendGraphs
    from streamer.model.packing import prepare
    from streamer.staging import PinnedRing

    cache = torch.zeros(1, 4, 4, 1, 8)
    base_graphs = DecodeGraphs(None, cache, cache, max_bs=8, max_pages=4)
    lora_graphs = DecodeGraphs(None, cache, cache, max_bs=8, max_pages=4, loras=True)
    extend = ExtendGraphs(None, cache, cache, 64, 8, max_pages=4, block_m=16)
    lora_extend = ExtendGraphs(None, cache, cache, 64, 8, max_pages=4, block_m=16, loras=True)

    def step(lens: list[int], loras: list[str | None], logprobs: bool = False):
        seqs = [SeqChunk(f"r{i}", [5] * n, 3, [1, 2], True, lora=lora) for i, (n, lora) in enumerate(zip(lens, loras))]
        if logprobs:
            seqs[0].logprob_from, seqs[0].logprob_targets = 0, [5] * (lens[0] - 1)
        batch = Batch(step=0, seqs=seqs, params=[], histories=[], banned=[])
        return prepare(batch, page_size=4, device=torch.device("cpu"), staging=PinnedRing(), graphs=base_graphs,
                       extend_graphs=extend, split_decode_tokens=1 << 16, last_tokens=torch.zeros(0),
                       last_rows={}, loras={"a@0": 1, "b@1": 2}, lora_graphs=(lora_graphs, lora_extend))

    x = step([1, 1, 1], ["b@1", None, "a@0"])
    assert x["graph"] is lora_graphs and x["lora_ids"].tolist() == [2, 0, 1]
    assert step([1, 1], [None, None])["graph"] is base_graphs
    assert step([4, 1], [None, None])["graph"] is extend
    x = step([4, 1], [None, "a@0"])
    assert x["graph"] is lora_extend and x["lora_ids"].tolist() == [0, 0, 0, 0, 1]
    assert step([4, 1], [None, None], logprobs=True)["graph"] is None
    x = step([4, 1], ["a@0", None], logprobs=True)
    assert x["graph"] is None and x["lora_ids"].tolist() == [1, 1, 1, 1, 0]


def test_the_lora_graphs_are_made_for_the_adapters_as_they_are(monkeypatch):
    """model/graphs.py LoraGraphs: none without adapters; made once there are, empty, with the
    base graphs' pool and limits; made anew after any adapter change (a load or unload, on this
    rank or as another rank's follower: Adapters.version), the device synchronized first."""
    from types import SimpleNamespace

    from streamer.model.graphs import DecodeGraphs, ExtendGraphs, LoraGraphs

    syncs: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: syncs.append(dev))
    cache = torch.zeros(1, 4, 4, 1, 8)
    base = DecodeGraphs(None, cache, cache, max_bs=8, max_pages=4, pool="decode-pool")
    base_extend = ExtendGraphs(None, cache, cache, 100, 6, max_pages=4, block_m=32, pool="decode-pool")
    adapters = SimpleNamespace(index={}, version=1)
    graphs = LoraGraphs(base, base_extend)
    assert graphs.current(adapters) == (None, None)
    adapters.index = {"a@0": 1}
    first, first_extend = graphs.current(adapters)
    assert first is not None and first.loras and first.pool == "decode-pool" and first.max_bs == base.max_bs
    assert first_extend is not None and first_extend.loras and first_extend.pool == "decode-pool"
    assert (first_extend.sizes, first_extend.max_seqs, first_extend.block_m) == (base_extend.sizes, 6, 32)
    assert graphs.current(adapters) == (first, first_extend) and not syncs
    assert first.graphs == {} and first_extend.graphs == {}
    adapters.version += 1
    second, second_extend = graphs.current(adapters)
    assert second is not None and second is not first and second_extend is not first_extend
    assert syncs == [cache.device]
    adapters.index, adapters.version = {}, adapters.version + 1
    assert graphs.current(adapters) == (None, None)
    assert LoraGraphs(base, None).current(SimpleNamespace(index={"a@0": 1}, version=0))[1] is None


def test_the_delta_adds_each_rows_adapter_alone_and_a_steps_masks_are_its_own():
    """LoraWeights.add_delta: y + ((x A^T) * M) B^T with M from this step's ids, for layers of two
    column layouts in one step (their masks computed once each, kept in the step's context), then a
    step with other ids (a context of its own: no mask of the step before is taken for it)."""
    from streamer.model.context import ForwardContext, set_context
    from streamer.model.lora import LoraWeights

    torch.manual_seed(0)

    def layer(width: int, n_in: int, n_out: int) -> LoraWeights:
        owner = torch.arange(1, 3).repeat_interleave(width)
        return LoraWeights(torch.randn(2 * width, n_in), torch.randn(n_out, 2 * width), owner)

    def want(lw: LoraWeights, y, x, ids):
        rows = []
        for t in range(len(x)):
            cols = lw.owner == ids[t]
            rows.append(y[t] + lw.b[:, cols] @ (lw.a[cols] @ x[t]) if ids[t] else y[t])
        return torch.stack(rows)

    layers = [layer(4, 8, 6), layer(4, 6, 8), layer(3, 8, 5)]
    for ids in (torch.tensor([0, 2, 1]), torch.tensor([1, 1, 0])):
        ctx = ForwardContext(torch.zeros(3), torch.zeros(3, 1), torch.zeros(3), torch.zeros(4), 1, torch.zeros(1),
                             torch.zeros(1), lora_ids=ids)
        set_context(ctx)
        try:
            for lw in layers:
                x, y = torch.randn(3, lw.a.shape[1]), torch.randn(3, lw.b.shape[0])
                expected = want(lw, y.clone(), x, ids)
                torch.testing.assert_close(lw.add_delta(y, x, ids), expected, rtol=1e-5, atol=1e-5)
        finally:
            set_context(None)
        assert sorted(n for n, _ in ctx.lora_masks) == [6, 8]  # (one mask a layout, kept with its step)


def test_a_lora_graph_that_cannot_be_captured_leaves_the_adapters_steps_eager(tiny_models, tmp_path):
    """A lazy capture that fails (here: CUDA graphs on the CPU) turns the LoRA graphs off with a
    warning that says why; that step and the later ones run eagerly, with the same output as an
    engine that never had them."""
    from streamer.model.graphs import DecodeGraphs, LoraGraphs

    base = tiny_models["llama3"]
    adapter = make_adapter(tmp_path / "one", base, ["q_proj", "v_proj"], rank=2, alpha=4, seed=1)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, lora="one")
    with LLM(str(base), lora_modules=(f"one={adapter}",)) as llm:
        want = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
    with LLM(str(base), lora_modules=(f"one={adapter}",)) as llm:
        runner = llm.engine.runner
        graphs = DecodeGraphs(runner.model, runner.pool.k, runner.pool.v, max_bs=4, max_pages=8)
        runner.lora_graphs = LoraGraphs(graphs, None)
        got = llm.generate([[5, 6, 7, 8]], params)[0]
        assert got.error is None and got.token_ids == want
        assert runner.lora_graphs.off is not None and "could not be captured" in runner.lora_graphs.off


def test_closing_an_engine_lets_its_lora_graphs_and_their_kv_tensors_go(tiny_models):
    """ModelRunner.release drops the LoRA graphs with the others: they hold the base graphs, and
    those the KV pool's tensors, which a second engine in the process needs the memory of."""
    import gc
    import weakref

    from streamer.model.graphs import DecodeGraphs, LoraGraphs

    with LLM(str(tiny_models["llama3"])) as llm:
        runner = llm.engine.runner
        runner.lora_graphs = LoraGraphs(DecodeGraphs(runner.model, runner.pool.k, runner.pool.v, 4, 8), None)
        kv = weakref.ref(runner.pool.k)
    assert runner.lora_graphs is None
    gc.collect()
    assert kv() is None, "nothing holds the KV pool's tensor after close"
