"""GGUF files as models: checked, converted once into the cache by transformers, then a folder.

A GGUF file is never run as is. transformers' GGUF loader (the oracle) reads it, dequantized,
and the result is saved as a plain HF folder (config.json + model.safetensors + tokenizer)
under cache_dir()/models/gguf/, which the loader then reads like any other folder.

NOTE the cache key. The folder is named after the file's resolved path (one folder per
source file, so a changed file replaces its conversion rather than piling up copies), and
holds a stamp (STAMP) with the file's size and mtime: a stamp that no longer matches the
file means the file changed, and it is converted again. A content hash would also catch a
rewrite that keeps size and mtime, but costs a full read of a multi-GB file at every start.

Dtypes: each tensor is stored in the narrowest float dtype that holds its values exactly
(float16, then bfloat16, else float32), so the folder is lossless whatever the file held:
an F16 or BF16 file stays 2 bytes a weight, while dequantized blocks (Q8_0 is a float16
scale times an int8, up to 19 significant bits) stay float32. The engine's `dtype` option
still decides the dtype the model runs in.

Before converting, a file is checked here, cheaply, so that each way it can be wrong is its
own ModelLoadError naming the file: missing, not GGUF (the magic), truncated or corrupt (the
header or a tensor's data past the end), a tensor type gguf cannot dequantize, an
architecture transformers cannot load or streamer's registry does not hold, and a rope
scaling transformers' GGUF loader would drop.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any, cast

from streamer.env import cache_dir
from streamer.errors import ModelLoadError

MAGIC = b"GGUF"
STAMP = "gguf-source.json"
"""In a converted folder: the source file's path, size and mtime when it was converted."""


def gguf_cache(override: str | None = None) -> Path:
    return cache_dir(override) / "models" / "gguf"


def converted_dir(path: Path, override: str | None = None) -> Path:
    """The cache folder of the GGUF file at `path` (resolved): its name, then a hash of its path."""
    path = path.resolve()
    key = sha256(str(path).encode()).hexdigest()[:12]
    return gguf_cache(override) / f"{path.name.removesuffix('.gguf')}-{key}"


def source_stamp(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def read_stamp(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None


def is_current(folder: Path, path: Path) -> bool:
    """folder holds a finished conversion of the file as it is now."""
    stamp = read_stamp(folder)
    return (stamp is not None and (folder / "config.json").is_file()
            and {k: stamp.get(k) for k in ("path", "size", "mtime_ns")} == source_stamp(path))


def ensure_converted(path: str | Path, override: str | None = None, log=print) -> Path:
    """The converted folder of a GGUF file, converting it first if the file is new or changed."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    folder = converted_dir(path, override)
    if is_current(folder, path):
        return folder
    info = check_gguf(path)
    log(f"streamer: converting {path} ({info.architecture}) into {folder} (once) ...")
    folder.parent.mkdir(parents=True, exist_ok=True)
    stamp = source_stamp(path)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".converting-") as tmp:
        out = Path(tmp) / "model"
        convert_gguf(path, out)
        (out / STAMP).write_text(json.dumps({**stamp, "architecture": info.architecture}, indent=1))
        # the stamp is written last: a folder that has one is complete (a crash leaves only tmp)
        shutil.rmtree(folder, ignore_errors=True)
        try:
            out.rename(folder)
        except OSError:
            if not is_current(folder, path):  # (else another process converted it meanwhile)
                raise
    return folder


@dataclass(frozen=True, slots=True)
class GgufInfo:
    architecture: str
    """general.architecture, as the file names it ("llama", "qwen2", ...)."""
    model_class: str
    """The transformers class it loads as ("LlamaForCausalLM")."""


def check_gguf(path: Path) -> GgufInfo:
    """Refuse, naming the file, what transformers or streamer cannot load (module docstring)."""
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    try:
        # (memory-mapped: the reader parses the header and views each tensor's bytes; a view
        # that would pass the end of the file fails, so truncation is found here)
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - whatever the parser trips on is the file's fault
        raise ModelLoadError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from None
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: has no general.architecture")
    for tensor in reader.tensors:
        if not _dequantizable(tensor.tensor_type):
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} is of type {tensor.tensor_type.name}, "
                                 "which gguf (transformers' GGUF loader) cannot dequantize")
    model_class = _transformers_class(path, arch)
    _check_rope_scaling(path, reader, arch)
    return GgufInfo(arch, model_class)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _dequantizable(qtype: Any) -> bool:
    """Asked of gguf itself (the dequantizer transformers calls), on one block of zeros."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    block, size = GGML_QUANT_SIZES[qtype]
    float_types = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    blocks = np.zeros(size * block if qtype in float_types else (1, size), np.uint8)
    try:
        dequantize(blocks, qtype)
    except NotImplementedError:
        return False
    return True


def _transformers_class(path: Path, arch: str) -> str:
    """The transformers class the file loads as, refused unless streamer's registry holds it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from streamer.model.registry import ARCHITECTURES

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} cannot be loaded by transformers ({e})") from None
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} (transformers' {name or config.model_type}) "
                             f"is not supported by streamer; supported: {', '.join(sorted(ARCHITECTURES))}")
    return name


def _check_rope_scaling(path: Path, reader: Any, arch: str) -> None:
    # transformers' GGUF config mapping reads no rope scaling: a file with one would load as an
    # unscaled model, and generate differently from what the file describes.
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling {kind!r} ({arch}.rope.scaling.type) is not read by "
                             "transformers' GGUF loader; convert the original checkpoint instead")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelLoadError(f"{path}: rope_freqs.weight (rope scaling factors) is not read by "
                             "transformers' GGUF loader; convert the original checkpoint instead")


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into a plain HF folder (dtypes: module docstring).

    save_pretrained refuses a model loaded from GGUF, so the class is rebuilt from its
    config (without the quantization entry) and given the state dict.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        src, loading = cast(tuple[Any, dict[str, Any]], AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, output_loading_info=True))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{gguf}: transformers cannot load it ({type(e).__name__}: {e})") from None
    if loading["missing_keys"]:
        # transformers would have initialized them at random
        raise ModelLoadError(f"{gguf}: has no tensor for {', '.join(sorted(loading['missing_keys']))}")
    state = src.state_dict()
    packed = [name for name, t in state.items() if not t.is_floating_point()]
    if packed:
        raise ModelLoadError(f"{gguf}: transformers kept {packed[0]!r} quantized; streamer needs it dequantized")
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(src).__name__]
    clean = type(src)(config)
    clean.load_state_dict(state)
    clean.save_pretrained(str(out), safe_serialization=True)
    for f in out.glob("*.safetensors"):
        narrow_safetensors(f)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{gguf}: transformers cannot rebuild its tokenizer ({type(e).__name__}: {e})") from None
    tok.save_pretrained(str(out))


def narrowest_exact(t: Any) -> Any:
    """t in float16 or bfloat16 where that holds every value exactly, else t itself."""
    import torch

    for dtype in (torch.float16, torch.bfloat16):
        if t.dtype.itemsize > dtype.itemsize and torch.equal(t.to(dtype).to(t.dtype), t):
            return t.to(dtype)
    return t


def narrow_safetensors(f: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(f), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {name: narrowest_exact(handle.get_tensor(name)) for name in handle.keys()}
    tmp = f.with_suffix(".narrow")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, f)


def converted_folders(override: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """(folder, stamp) of every finished conversion in the cache, for `streamer models list`."""
    root = gguf_cache(override)
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        stamp = read_stamp(folder)
        if stamp is not None:
            found.append((folder, stamp))
    return found
