"""Build a model from a local Hugging Face folder.

config.json picks the class (registry.py); weights come from model.safetensors
or the shards listed in model.safetensors.index.json, or are random of the
real shapes with load_format="dummy" (benchmarks). Every failure is a
ModelLoadError that names the file, and the tensor where there is one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from streamer.config import QUANTIZATIONS
from streamer.env import dummy_init
from streamer.errors import ModelLoadError
from streamer.model import fp8_checkpoint, fp8_config, int4_checkpoint
from streamer.model.config_check import check_config
from streamer.model.experts import Experts
from streamer.model.layers import Linear, RMSNorm, deferred_weights, materialize
from streamer.model.llama import DecoderLayer, LlamaForCausalLM
from streamer.model.registry import HEADS, model_class
from streamer.model.rope import default_dtype, longrope_note
from streamer.model.tp_group import current as tensor_parallel

log = logging.getLogger("streamer.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    cfg_file = path / "config.json"
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such model folder")
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file}: missing (a model folder needs config.json)")
    try:
        json.loads(cfg_file.read_text())
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is the user's file
        raise ModelLoadError(f"{cfg_file}: cannot be read as a model config ({e})") from None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's files: safetensors (an index's shards, model.safetensors, or every
    *.safetensors), else PyTorch's pickles (pytorch_model.bin, or an index's shards: older
    checkpoints and most EAGLE-3 heads ship those)."""
    for kind, single in (("safetensors", "model.safetensors"), ("bin", "pytorch_model.bin")):
        index = path / f"{single}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"{index}: not a valid {kind} index ({e})") from None
            files = [path / s for s in shards]
            for f in files:
                if not f.is_file():
                    raise ModelLoadError(f"{f}: missing shard listed in {index.name}")
            return files
        if (path / single).is_file():
            return [path / single]
        found = sorted(path.glob("*.safetensors" if kind == "safetensors" else "pytorch_model*.bin"))
        if found:
            return found
    raise ModelLoadError(f"{path}: no model.safetensors, pytorch_model.bin, or an index of either")


def iter_safetensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, Any, str]]:
    """(name, tensor, file) of every tensor of the checkpoint's files. lazy: safetensors'
    slices instead of tensors (a tensor-parallel rank reads its part). A .bin file is
    unpickled with tensors only (torch.load's weights_only: no code in it runs), memory-mapped."""
    from safetensors import safe_open

    for f in files:
        if f.suffix == ".bin":
            try:
                try:
                    state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # (a file from before PyTorch 1.6's zip format cannot be mapped)
                    state = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"{f}: not a readable PyTorch checkpoint of tensors ({e})") from None
            if not isinstance(state, dict):
                raise ModelLoadError(f"{f}: not a state dict (name -> tensor) but {type(state).__name__}")
            for name, tensor in state.items():
                yield name, tensor, f.name
            continue
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"{f}: not a readable safetensors file, truncated or corrupt ({e})") from None
        with handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_slice(name) if lazy else handle.get_tensor(name)
                except Exception as e:  # noqa: BLE001
                    raise ModelLoadError(f"{f}: tensor {name!r} cannot be read ({e})") from None
                yield name, tensor, f.name


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a model folder's checkpoint (an EAGLE-3 head's copy of its tensor-parallel
    target's embeddings, which each rank holds a slice of)."""

    for n, tensor, _ in iter_safetensors(weight_files(path), lazy=True):
        if n == name:
            return tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
    raise ModelLoadError(f"{path}: no tensor {name!r} in its checkpoint")


@contextmanager
def no_init() -> Iterator[None]:
    """Layers built without their random initialization: load_model fills every weight (from
    the checkpoint, which must have them all, or with dummy values). Kaiming-initializing the
    default model's linear layers took 2 of an engine start's 8 s on CPU."""
    saved = torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = _skip  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def _skip(self: torch.nn.Module) -> None:
    pass


def load_model(
    path: str | Path,
    *,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    max_positions: int | None = None,
    seed: int = 0,
    quantization: str | None = None,
    draft_head: str | None = None,
) -> tuple[LlamaForCausalLM, Any]:
    """(model in eval mode on device, transformers config). draft_head: the speculative
    method ("eagle3", "eagle") whose head is wanted (model/eagle_heads.py), and only then is
    a head accepted. quantization "fp8": the
    decoder's linear layers are converted to float8 once loaded (streamer/model/quant.py).
    A checkpoint whose config.json has a quantization_config is loaded as it is stored
    (model/fp8_checkpoint.py: float8, int4 through model/int4_checkpoint.py, or refused);
    quantization may name its format (config.CHECKPOINT_FORMATS: checked, fp8_config.confirm_format)."""
    path = Path(path)
    device = torch.device(device)
    if quantization not in (None, *QUANTIZATIONS):
        raise ModelLoadError(f"quantization {quantization!r} is not supported ({', '.join(QUANTIZATIONS)} or none)")
    hf_config = load_hf_config(path)
    source = str(path / "config.json")
    quantization = fp8_config.confirm_format(hf_config, source, quantization)
    scheme: Any = int4_checkpoint.scheme_of(hf_config, source, quantization) \
        or fp8_config.read_scheme(hf_config, source, quantization)
    archs = getattr(hf_config, "architectures", None)
    cls = model_class(archs, str(path / "config.json"))
    if draft_head is not None and cls is LlamaForCausalLM:
        # (the published EAGLE heads of Llama targets name the Llama class: the method says what they are)
        cls = HEADS[draft_head]
    method = getattr(cls, "head_method", None)
    if method != draft_head:
        if draft_head is not None:
            raise ModelLoadError(f"{source}: architectures {archs!r} is not a head of speculative_config method "
                                 f"{draft_head!r} ({HEADS[draft_head].__name__}); a small model with the target's "
                                 "vocabulary runs with method 'draft_model'")
        raise ModelLoadError(f"{source}: an EAGLE head, which proposes tokens for the model it was trained for: "
                             f"serve that model with speculative_config {{\"method\": \"{method}\", \"model\": "
                             f"\"{path}\"}}")
    torch_dtype = resolve_dtype(dtype, device)
    max_positions = max_positions or getattr(hf_config, "max_position_embeddings", 4096)
    check_config(hf_config, cls, max_positions, str(path / "config.json"))
    note = longrope_note(hf_config, max_positions)
    if note:
        log.warning("%s: %s", path, note)
    files = [] if load_format == "dummy" else weight_files(path)
    # (in its dtype: no float32 copy first; a quantized checkpoint's weights on the meta device
    # until prepare has given the quantized layers theirs: layers.deferred_weights)
    with torch.device(device), default_dtype(torch_dtype), no_init(), \
            (deferred_weights() if scheme is not None else nullcontext()):
        model = cls(hf_config, max_positions)
    tables = {n: b for n, b in model.named_buffers() if n.startswith("cos_sin")}
    model.to(torch_dtype)
    for m in model.modules():
        if getattr(m, "float32", False):  # (routers transformers keeps in float32: glm4_moe.py)
            m.float()
    for p in model.parameters():
        if getattr(p, "float32", False):  # (parameters the kernels read as float32: attention sinks)
            p.data = p.data.float()
    for n, b in tables.items():
        setattr(model, n, b.to(device))  # rotary tables stay float32
    # (one module per kind of quantized checkpoint, with the same four steps)
    ckpt: Any = int4_checkpoint if isinstance(scheme, int4_checkpoint.Int4Scheme) else fp8_checkpoint
    quantized = set() if scheme is None else ckpt.prepare(model, scheme, device, str(path / "config.json"))
    materialize(model, device)
    with torch.no_grad():
        if load_format == "dummy":
            gen = torch.Generator(device=device).manual_seed(seed)
            uniform = dummy_init() == "uniform"
            norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm)}
            for name, p in model.named_parameters():
                if uniform and p.is_floating_point() and p.dtype != torch.float8_e4m3fn \
                        and not name.endswith("weight_scale"):
                    # (vLLM's dummy values, env.dummy_init: each parameter drawn from the seed anew, so that
                    # parameters of one shape hold the same values, an embedding and an untied LM head included)
                    p.uniform_(-1e-3, 1e-3, generator=gen.manual_seed(seed))
                    continue
                if name in norms or not p.is_floating_point():
                    continue  # (norms keep their neutral weight: 1, or 0 with an offset; int4 layers below)
                if p.dtype == torch.float8_e4m3fn:  # a float8 checkpoint's layer: W ~ N(0, 0.02) with the scale below
                    p.copy_(torch.randn(p.shape, generator=gen, device=device).to(p.dtype))
                elif name.endswith("weight_scale"):
                    p.fill_(0.02)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
            for m in model.modules():
                if isinstance(m, Experts) and m.gate_up_proj_scale is not None:  # float8 experts' scales
                    m.gate_up_proj_scale.fill_(0.02)
                    m.down_proj_scale.fill_(0.02)
            int4_checkpoint.fill_dummy(model, gen)
        else:
            tensors = (x for x in iter_safetensors(files, lazy=tensor_parallel() is not None)
                       if not model.skips_tensor(x[0]))
            model.load_weights(tensors if scheme is None else ckpt.checkpoint_tensors(tensors, scheme, quantized))
        model.loaded()
        if scheme is not None:
            ckpt.finish(model)
        elif quantization == "fp8":
            tp = tensor_parallel()
            for name, m in model.named_modules():
                # the LM head stays in the model's dtype (as in the usual fp8 checkpoints)
                if isinstance(m, Linear) and name != "lm_head":
                    # (every rank walks the same modules: the row-parallel ones' collectives pair up)
                    row_parallel = tp is not None and name.rsplit(".", 1)[-1] in ("o_proj", "down_proj")
                    m.quantize_fp8(tp if row_parallel else None)
                elif isinstance(m, Experts):
                    m.quantize_fp8(tp)
        if scheme is not None or quantization == "fp8":
            for m in model.modules():
                if isinstance(m, DecoderLayer):
                    m.link_fp8_norms()
        if (scheme is not None or quantization == "fp8") and device.type == "cuda":
            torch.cuda.empty_cache()  # the bf16 weights' blocks go back: the KV pool is sized from free memory
    return model.eval(), hf_config
