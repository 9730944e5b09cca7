"""Loading a local HF folder: sharded safetensors, dummy weights, and one clear
message (file and tensor named) for each way a folder can be broken."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamer.errors import ConfigError, ModelLoadError
from streamer.model.loader import load_model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


@pytest.fixture
def qwen2(tiny_models, tmp_path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(tiny_models["qwen2"], dst)
    return dst


def test_sharded_checkpoint_loads_the_same_weights(qwen2):
    whole, _ = load_model(qwen2)
    tensors = load_file(str(qwen2 / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(qwen2 / fname))
    (qwen2 / "model.safetensors").unlink()
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (qwen2 / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _ = load_model(qwen2)
    for (n, a), (_, b) in zip(whole.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), n


def test_pytorch_bin_checkpoints_load_the_same_weights(qwen2):
    """pytorch_model.bin, whole or sharded under its index (unpickled with tensors only)."""
    whole, _ = load_model(qwen2)
    tensors = load_file(str(qwen2 / "model.safetensors"))
    (qwen2 / "model.safetensors").unlink()
    torch.save(tensors, str(qwen2 / "pytorch_model.bin"))
    from_bin, _ = load_model(qwen2)
    names = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": names[:3], "pytorch_model-00002-of-00002.bin": names[3:]}
    for fname, keys in shards.items():
        torch.save({k: tensors[k] for k in keys}, str(qwen2 / fname))
    (qwen2 / "pytorch_model.bin").unlink()
    (qwen2 / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    sharded, _ = load_model(qwen2)
    for (n, a), (_, b), (_, c) in zip(whole.named_parameters(), from_bin.named_parameters(),
                                      sharded.named_parameters()):
        assert torch.equal(a, b) and torch.equal(a, c), n
    torch.save({k: tensors[k] for k in shards["pytorch_model-00001-of-00002.bin"]},
               str(qwen2 / "pytorch_model-00001-of-00002.bin"), _use_new_zipfile_serialization=False)
    legacy, _ = load_model(qwen2)  # (a file from before PyTorch 1.6's zip format: not memory-mapped)
    for (n, a), (_, b) in zip(whole.named_parameters(), legacy.named_parameters()):
        assert torch.equal(a, b), n
    (qwen2 / "pytorch_model-00001-of-00002.bin").write_bytes(b"not a pickle")
    with pytest.raises(ModelLoadError, match="pytorch_model-00001-of-00002.bin: not a readable PyTorch checkpoint"):
        load_model(qwen2)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b", "qwen3-8b", "smollm2-135m"])
def test_benchmark_configs_build_with_dummy_weights_on_meta(name):
    from streamer.model.loader import load_hf_config
    from streamer.model.registry import model_class

    cfg = load_hf_config(BENCH / name)
    cls = model_class(cfg.architectures, name)
    with torch.device("meta"):
        model = cls(cfg, 128)
    n = sum(p.numel() for p in model.parameters())
    assert n > 1e8


def test_dummy_weights_need_no_weight_file(tmp_path):
    shutil.copy(BENCH / "smollm2-135m" / "config.json", tmp_path / "config.json")
    model, _ = load_model(tmp_path, load_format="dummy", max_positions=64)
    assert model.layers[0].mlp.gate_up_proj.weight.std() > 0


def test_dummy_weights_can_take_vllms_values(tmp_path, monkeypatch):
    """STREAMER_DUMMY_INIT=uniform: every floating weight, the norms' too, U(-1e-3, 1e-3), as
    vLLM's dummy loader fills them (env.dummy_init): each drawn from the seed anew, so that
    weights of one shape are equal (every layer's); normal keeps the norms at 1 and draws one
    stream."""
    shutil.copy(BENCH / "smollm2-135m" / "config.json", tmp_path / "config.json")
    normal, _ = load_model(tmp_path, load_format="dummy", max_positions=64)
    assert torch.equal(normal.norm.weight, torch.ones_like(normal.norm.weight))
    monkeypatch.setenv("STREAMER_DUMMY_INIT", "uniform")
    model, _ = load_model(tmp_path, load_format="dummy", max_positions=64)
    for name, p in model.named_parameters():
        assert 0 < p.abs().max() <= 1e-3 and p.std() > 4e-4, name  # (U(-a, a) has std a / sqrt(3))
    first, second = (layer.mlp.gate_up_proj.weight for layer in model.layers[:2])
    assert torch.equal(first, second)
    assert not torch.equal(*(layer.mlp.gate_up_proj.weight for layer in normal.layers[:2]))
    monkeypatch.setenv("STREAMER_DUMMY_INIT", "kaiming")
    with pytest.raises(ConfigError, match="STREAMER_DUMMY_INIT must be one of normal, uniform, got 'kaiming'"):
        load_model(tmp_path, load_format="dummy", max_positions=64)


def expect_error(path, *fragments):
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_unknown_architecture_is_named(qwen2):
    cfg = json.loads((qwen2 / "config.json").read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    (qwen2 / "config.json").write_text(json.dumps(cfg))
    expect_error(qwen2, "config.json", "FancyForCausalLM", "supported")


def test_missing_shard_is_named(qwen2):
    (qwen2 / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    expect_error(qwen2, "model-00002-of-00002.safetensors", "missing shard")


def test_truncated_file_is_named(qwen2):
    f = qwen2 / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    expect_error(qwen2, "model.safetensors")


def test_shape_mismatch_names_the_tensor(qwen2):
    tensors = load_file(str(qwen2 / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(qwen2 / "model.safetensors"))
    expect_error(qwen2, "model.layers.0.mlp.down_proj.weight", "(3, 3)", "expects")


def test_missing_tensor_is_named(qwen2):
    tensors = load_file(str(qwen2 / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(qwen2 / "model.safetensors"))
    expect_error(qwen2, "norm.weight", "missing")


def test_missing_folder_and_config(tmp_path):
    expect_error(tmp_path / "nope", "no such model folder")
    expect_error(tmp_path, "config.json")


def test_cli_prints_one_line_not_a_traceback(qwen2):
    (qwen2 / "model.safetensors").unlink()
    r = subprocess.run(
        [sys.executable, "-m", "streamer", "generate", "--model", str(qwen2), "hello"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("streamer: error:") and "model.safetensors" in r.stderr
