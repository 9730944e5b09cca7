"""`bench offline --lora-rank` (bench/lora.py): a random adapter of the config's shapes, which the
engine takes for every adaptable layer (attention's alone for a mixture of experts)."""

from __future__ import annotations

import json

import pytest

from streamer.bench.lora import layer_shapes, random_adapter
from streamer.model.lora import read_adapter


def test_the_random_adapter_fits_every_adaptable_layer_of_the_model(tiny_models, tmp_path):
    from streamer import LLM, SamplingParams

    base = tiny_models["llama3"]
    cfg = json.loads((base / "config.json").read_text())
    folder = random_adapter(base, 4, tmp_path / "lora")
    adapter = read_adapter("bench", str(folder))
    assert adapter.rank == 4 and len(adapter.weights) == 7 * cfg["num_hidden_layers"]
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    adapted = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, lora="bench")
    with LLM(str(base), lora_modules=(f"bench={folder}",)) as llm:
        outs = llm.generate([[5, 6, 7, 8]] * 2, [plain, adapted])
    assert all(o.error is None and len(o.token_ids) == 4 for o in outs)


def test_a_mixture_of_experts_adapter_holds_attention_alone():
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "intermediate_size": 128, "num_experts": 8}
    assert layer_shapes(cfg) == {"q_proj": ("self_attn", 64, 128), "k_proj": ("self_attn", 64, 64),
                                 "v_proj": ("self_attn", 64, 64), "o_proj": ("self_attn", 128, 64)}
    dense = layer_shapes({**cfg, "num_experts": None})
    assert dense["down_proj"] == ("mlp", 128, 64) and dense["gate_proj"] == ("mlp", 64, 128)


def test_a_rank_below_one_is_refused_by_name(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="--lora-rank"):
        random_adapter(tiny_models["llama3"], 0, tmp_path / "lora")
