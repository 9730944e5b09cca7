"""LoRA adapters under tensor parallelism (gloo, CPU, float32): each rank holds its part of every
adapter (model/lora.py _rank_part: B's rows of a column-parallel layer, A's columns of a
row-parallel one), and two ranks answer the base model's and two adapters' requests, batched
together, as one rank does: the same greedy tokens, logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from tests.conftest import make_tiny_model
from tests.model.lora_files import make_adapter
from tests.model.test_lora import ALL


def answers(path, adapters, **kw):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 29, 70)]
    asked = [(p, lora) for p in prompts for lora in (None, "one", "two")]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1, lora=lora) for _, lora in asked]
    modules = tuple(f"{name}={folder}" for name, folder in adapters.items())
    with LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32, lora_modules=modules, **kw) as llm:
        outs = llm.generate([p for p, _ in asked], params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in outs]


@pytest.mark.parametrize("family", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_two_ranks_answer_adapters_as_one(tmp_path, family):
    base = make_tiny_model(tmp_path / "base", family, None)
    adapters = {"one": make_adapter(tmp_path / "one", base, ALL, rank=4, alpha=8, seed=1),
                "two": make_adapter(tmp_path / "two", base, ["q_proj", "v_proj", "down_proj"], rank=2, alpha=4,
                                    seed=2, rslora=True)}
    one, two = answers(base, adapters), answers(base, adapters, tensor_parallel_size=2)
    for (t1, l1), (t2, l2) in zip(one, two, strict=True):
        assert t2 == t1
        assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-4
    assert len({tuple(t) for t, _ in one[:3]}) > 1, "the adapters change the output"


def test_an_adapter_loaded_while_two_ranks_serve_answers_as_one_loaded_at_start(tmp_path):
    """RankLora: every rank reads the folder between two steps; unloaded, the name is refused."""
    base = make_tiny_model(tmp_path / "base", "LlamaForCausalLM", None)
    adapters = {"one": make_adapter(tmp_path / "one", base, ALL, rank=4, alpha=8, seed=1)}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 29, 70)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1, lora="one")
    kw = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 32}
    with LLM(str(base), lora_modules=(f"one={adapters['one']}",), **kw) as llm:
        want = llm.generate(prompts, params)
    with LLM(str(base), tensor_parallel_size=2, allow_runtime_lora_updating=True, **kw) as llm:
        with pytest.raises(ModelLoadError, match="adapter_config.json"):
            llm.load_lora("one", str(tmp_path))
        llm.load_lora("one", str(adapters["one"]))
        got = llm.generate(prompts, params)
        llm.unload_lora("one")
        gone = llm.generate(prompts[:1], params)[0]
        after = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))[0]
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert gone.finish_reason == "error" and "'one'" in gone.error and after.error is None


def test_an_adapter_of_a_fused_checkpoint_layer_is_refused_under_tensor_parallelism(tmp_path):
    from safetensors.torch import load_file, save_file

    base = make_tiny_model(tmp_path / "base", "LlamaForCausalLM", None)
    folder = make_adapter(tmp_path / "fused", base, ["q_proj"], rank=2, alpha=2, seed=1)
    tensors = {k.replace("q_proj", "qkv_proj"): v for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="fused layer"):
        LLM(str(base), dtype="float32", device="cpu", tensor_parallel_size=2, lora_modules=(f"fused={folder}",))


def test_two_ranks_with_a_draft_model_keep_an_adapters_greedy_output(tmp_path):
    """Tensor parallelism, speculative decoding (the draft whole on rank 0) and an adapter together:
    the verify chunks, sent to every rank, carry the request's adapter."""
    base = make_tiny_model(tmp_path / "base", "LlamaForCausalLM", None)
    one = make_adapter(tmp_path / "one", base, ALL, rank=4, alpha=8, seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 50, (n,), generator=g).tolist() * 3 for n in (5, 12, 20)]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, lora=name) for name in ("one", None, "one")]
    kw = {"dtype": "float32", "device": "cpu", "lora_modules": (f"one={one}",)}
    with LLM(str(base), **kw) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    spec = {"method": "draft_model", "model": str(base), "num_speculative_tokens": 3}
    with LLM(str(base), speculative_config=spec, tensor_parallel_size=2, **kw) as llm:
        outs = llm.generate(prompts, params)
        assert llm.stats().spec_draft_tokens > 0
    assert [o.token_ids for o in outs] == want
