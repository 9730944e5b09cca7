"""A GGUF file is a model: converted once into the cache by transformers' GGUF loader, it
generates what transformers generates from the file itself; a changed file is converted
again, and a file streamer cannot run is refused with an error naming it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from streamer import LLM
from streamer.errors import ModelLoadError
from streamer.model import gguf as gguf_mod
from streamer.model.registry import ARCHITECTURES
from streamer.model.source import is_gguf, model_name, resolve_model
from tests.conftest import make_tiny_model
from tests.model.gguf_files import VOCAB, write_gguf, write_header_only
from tests.model.test_greedy_vs_transformers import GREEDY, assert_matches, prompts
from tests.oracle import Comparison, compare


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    return {
        "llama": make_tiny_model(root / "llama", "LlamaForCausalLM", None, vocab_size=VOCAB),
        "qwen2": make_tiny_model(root / "qwen2", "Qwen2ForCausalLM", None, vocab_size=VOCAB),
    }


@pytest.fixture
def llama_gguf(tiny_hf, default_model, tmp_path) -> Path:
    return write_gguf(tiny_hf["llama"], tmp_path / "tiny-llama.gguf", default_model)


def transformers_weights(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_output_from_a_gguf_file_equals_transformers_generate_from_it(family, tiny_hf, default_model, tmp_path):
    path = write_gguf(tiny_hf[family], tmp_path / f"tiny-{family}.gguf", default_model)
    with LLM(str(path), cache_dir=str(tmp_path / "cache")) as llm:
        assert llm.engine.model_name == f"tiny-{family}"
        batch = prompts(llm.tokenizer, 3, 5, 40)
        outs = llm.generate(batch, GREEDY)
    cmp = Comparison()
    for p, o in zip(batch, outs):
        assert o.error is None, o.error
        compare(path, p, o.token_ids, cmp)  # the oracle: transformers reading the .gguf file
    assert_matches(cmp, len(batch))


@pytest.mark.parametrize(("tensor_type", "stored"), [
    ("F32", torch.float32),
    ("F16", torch.float16),   # half the bytes, and still exact
    ("Q8_0", torch.float32),  # a float16 scale times an int8: exact only in float32
])
def test_the_converted_folder_holds_exactly_the_weights_transformers_reads(
        tensor_type, stored, tiny_hf, default_model, tmp_path):
    from safetensors.torch import load_file

    path = write_gguf(tiny_hf["llama"], tmp_path / "tiny.gguf", default_model, tensor_type)
    folder = resolve_model(str(path), str(tmp_path / "cache"))
    ours = load_file(str(folder / "model.safetensors"))
    theirs = transformers_weights(path)
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(t.float(), theirs[name]), name
    assert {t.dtype for t in ours.values() if t.ndim == 2} == {stored}


def test_a_second_use_does_not_convert_again_and_a_changed_file_does(
        llama_gguf, tiny_hf, default_model, tmp_path, monkeypatch):
    conversions = []
    convert = gguf_mod.convert_gguf
    monkeypatch.setattr(gguf_mod, "convert_gguf", lambda src, out: (conversions.append(src), convert(src, out)))
    cache = str(tmp_path / "cache")

    folder = resolve_model(str(llama_gguf), cache)
    assert resolve_model(str(llama_gguf), cache) == folder
    assert len(conversions) == 1

    write_gguf(tiny_hf["qwen2"], llama_gguf, default_model)  # other contents at the same path
    assert resolve_model(str(llama_gguf), cache) == folder
    assert len(conversions) == 2
    assert gguf_mod.read_stamp(folder)["architecture"] == "qwen2"

    st = llama_gguf.stat()
    os.utime(llama_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: as good as changed
    resolve_model(str(llama_gguf), cache)
    assert len(conversions) == 3
    assert [p.name for p in (tmp_path / "cache" / "models" / "gguf").iterdir()] == [folder.name], \
        "a conversion replaces the one before it, in place"


def test_models_pull_converts_and_models_list_says_whether_each_file_changed(llama_gguf, tmp_path, capsys):
    from streamer.cli import main

    cache = str(tmp_path / "cache")
    main(["models", "pull", str(llama_gguf), "--cache-dir", cache])
    folder = Path(capsys.readouterr().out.strip())
    assert gguf_mod.is_current(folder, llama_gguf)

    def listed() -> str:
        main(["models", "list", "--cache-dir", cache])
        (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("gguf")]
        assert str(folder) in line and str(llama_gguf) in line
        return line

    assert listed().endswith("current")
    os.utime(llama_gguf, ns=(0, 10**9))
    assert listed().endswith("source changed: converted again at next use")
    llama_gguf.unlink()
    assert listed().endswith("source missing")


def broken_files(tmp: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a file that cannot be run, what its error says)."""
    not_gguf = tmp / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    truncated = tmp / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    return {
        "missing": (tmp / "absent.gguf", "no such GGUF file"),
        "not gguf": (not_gguf, "not a GGUF file (it starts with b'PK\\x03\\x04'"),
        "truncated": (truncated, "not a readable GGUF file, truncated or corrupt"),
        "transformers cannot load it": (write_header_only(tmp / "rwkv.gguf", "rwkv6"),
                                        "GGUF architecture 'rwkv6' cannot be loaded by transformers"),
        "streamer has no such class": (write_header_only(tmp / "gpt2.gguf", "gpt2"),
                                       "GGUF architecture 'gpt2' (transformers' GPT2LMHeadModel) is not supported"),
        "rope scaling transformers drops": (
            write_header_only(tmp / "scaled.gguf", "llama", **{"llama.rope.scaling.type": "yarn"}),
            "rope scaling 'yarn' (llama.rope.scaling.type) is not read by transformers' GGUF loader"),
    }


CASES = ["missing", "not gguf", "truncated", "transformers cannot load it", "streamer has no such class",
         "rope scaling transformers drops"]


@pytest.mark.parametrize("case", CASES)
def test_a_file_that_cannot_be_run_is_refused_naming_the_file(case, llama_gguf, tmp_path):
    path, message = broken_files(tmp_path, llama_gguf)[case]
    with pytest.raises(ModelLoadError) as e:
        LLM(str(path), cache_dir=str(tmp_path / "cache"))
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)
    assert not list((tmp_path / "cache").rglob("config.json")), "nothing converted"


def test_a_tensor_type_gguf_cannot_dequantize_is_refused(tiny_hf, default_model, tmp_path):
    path = write_gguf(tiny_hf["llama"], tmp_path / "f64.gguf", default_model, "F64")
    with pytest.raises(ModelLoadError, match=r"f64.gguf: tensor '[\w.]+' is of type F64, which gguf"):
        resolve_model(str(path), str(tmp_path / "cache"))


def test_architectures_are_gated_on_what_the_registry_holds_at_load(tmp_path, monkeypatch):
    path = write_header_only(tmp_path / "qwen.gguf", "qwen2")
    assert gguf_mod.check_gguf(path).model_class == "Qwen2ForCausalLM"
    monkeypatch.delitem(ARCHITECTURES, "Qwen2ForCausalLM")
    with pytest.raises(ModelLoadError, match="GGUF architecture 'qwen2' .* is not supported by streamer"):
        gguf_mod.check_gguf(path)


def test_the_cli_prints_the_error_and_exits_2_without_a_traceback(tmp_path, capsys):
    from streamer.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(bad), "--cache-dir", str(tmp_path), "hello"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"streamer: error: {bad}: not a GGUF file (it starts with b'GGML', not b'GGUF')\n"


def test_a_model_value_names_a_folder_a_gguf_file_or_the_default(tmp_path):
    folder = tmp_path / "odd.gguf"  # a folder, whatever its name
    folder.mkdir()
    assert not is_gguf(str(folder)) and resolve_model(str(folder)) == folder
    assert is_gguf(str(tmp_path / "absent.gguf")) and is_gguf(str(tmp_path / "absent.GGUF"))
    (tmp_path / "weights.bin").write_bytes(b"")
    assert is_gguf(str(tmp_path / "weights.bin"))  # any file: refused by its magic if not GGUF
    assert [model_name(m) for m in ("default", "/x/SmolLM2.Q4_1.gguf", "/x/my-model", str(folder))] == \
        ["default", "SmolLM2.Q4_1", "my-model", "odd.gguf"]
