"""The quantization_config of a float8 checkpoint, read into an `Fp8Scheme` (what
model/fp8_checkpoint.py loads): transformers' FineGrainedFP8 (quant_method "fp8") and
compressed-tensors' float-quantized formats, as that module's docstring describes them. Fields
and values this reader does not know are refused by name (`refuse`); int4 methods are read by
model/int4_checkpoint.py, which shares the compressed-tensors helpers here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from streamer.config import CHECKPOINT_FORMATS
from streamer.errors import ModelLoadError

FINEGRAINED_FIELDS = {"quant_method", "activation_scheme", "weight_block_size", "fmt", "modules_to_not_convert",
                      "ignored_layers", "modules_to_convert", "dequantize", "scale_fmt", "expert_dtype"}
CT_FIELDS = {"quant_method", "config_groups", "format", "ignore", "quantization_status", "kv_cache_scheme",
             "sparsity_config", "transform_config", "version", "global_compression_ratio"}
CT_GROUP_FIELDS = {"targets", "weights", "input_activations", "output_activations", "format"}
CT_ARGS_FIELDS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                  "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How a checkpoint's float8 layers are stored and run."""

    method: str
    weights: str
    """"tensor", "channel" or "block": what one weight scale covers."""
    act: str
    """The inputs' dynamic scales: "token", "tensor" (one per call) or "group" (1 x block[1])."""
    block: tuple[int, int] | None
    skip: tuple[str, ...]
    """Layers kept in the model's dtype, as the format writes them (names, patterns)."""
    targets: tuple[str, ...] = ("Linear",)

    def quantized(self, module: str) -> bool:
        """Whether the linear layer of this transformers name is float8 in the checkpoint."""
        if self.method == "fp8":
            return not any(_transformers_skips(module, p) for p in self.skip)
        if any(_ct_matches(module, p) for p in self.skip):
            return False
        return any(t == "Linear" or _ct_matches(module, t) for t in self.targets)


def _transformers_skips(name: str, pattern: str) -> bool:
    # transformers' modules_to_not_convert: a prefix ending at a module boundary, a regex
    # with the same boundary, or a suffix ("mlp.gate" skips "mlp.gate", not "mlp.gate_proj")
    return bool(re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name)) or name.endswith(pattern)


def _ct_matches(name: str, pattern: str) -> bool:
    # compressed-tensors: "re:<regex>" matched from the start of the name, else the exact name
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def refuse(source: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: quantization_config {what}")


def confirm_format(hf_config: Any, source: str, requested: str | None) -> str | None:
    """`requested` as the schemes' readers take it: None and "fp8" unchanged; a checkpoint format's name
    (config.CHECKPOINT_FORMATS) checked against config.json's quant_method, then None (the checkpoint
    runs as stored, as it would with no value)."""
    if requested not in CHECKPOINT_FORMATS:
        return requested
    qc = getattr(hf_config, "quantization_config", None)
    method = None if qc is None else (qc if isinstance(qc, dict) else qc.to_dict()).get("quant_method")
    if method != CHECKPOINT_FORMATS[requested]:
        found = (f"quant_method {method!r}" if method is not None else
                 "no quantization_config (an unquantized checkpoint: streamer quantizes to fp8 only at load)")
        raise ModelLoadError(f"{source}: quantization={requested!r} names a {CHECKPOINT_FORMATS[requested]!r} "
                             f"checkpoint, but config.json has {found}")
    return None


def read_scheme(hf_config: Any, source: str, requested: str | None) -> Fp8Scheme | None:
    """The checkpoint's float8 scheme, None for an unquantized checkpoint (model/loader.py
    asks int4_checkpoint.scheme_of first: int4 methods never reach here). `requested` is
    EngineConfig.quantization: "fp8" agrees with a float8 checkpoint (which then runs as
    stored), and conflicts with any other quant_method."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method == "mxfp4":
        _check_mxfp4(hf_config, qc, source, requested)
        return None  # (model/gpt_oss.py dequantizes the experts as they load)
    if method == "fp8":
        return _finegrained(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if requested is not None:
        raise refuse(source, f"quant_method {method!r} conflicts with quantization={requested!r} (a checkpoint "
                     "quantized another way cannot be converted to float8 at load)")
    raise refuse(source, f"quant_method {method!r} is not supported; streamer runs float8 checkpoints "
                 "(quant_method 'fp8', or 'compressed-tensors' with float8 weights), int4 ones ('awq', 'gptq', "
                 "'compressed-tensors' pack-quantized) and unquantized ones")


def _check_mxfp4(hf_config: Any, qc: dict, source: str, requested: str | None) -> None:
    """gpt-oss's MXFP4 experts (the released checkpoints): the one architecture and layout
    that model/gpt_oss.py reads; every other module must be unquantized in the file."""
    from streamer.model.gpt_oss import MXFP4_FIELDS

    archs = getattr(hf_config, "architectures", None) or []
    if "GptOssForCausalLM" not in archs:
        raise refuse(source, f"quant_method 'mxfp4' is supported for GptOssForCausalLM only, not {archs}")
    unknown = sorted(set(qc) - MXFP4_FIELDS)
    if unknown:
        raise refuse(source, f"field {unknown[0]!r} is not understood (quant_method 'mxfp4')")
    if requested is not None:
        raise refuse(source, f"quantization={requested!r} with an MXFP4 checkpoint: its experts are dequantized "
                     "at load and the rest is stored unquantized; pass no quantization")


def _finegrained(qc: dict, source: str) -> Fp8Scheme:
    unknown = sorted(set(qc) - FINEGRAINED_FIELDS)
    if unknown:
        raise refuse(source, f"field {unknown[0]!r} is not understood (quant_method 'fp8')")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(source, f"fmt {qc['fmt']!r} is not supported (float8 e4m3 only)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(source, f"activation_scheme {qc['activation_scheme']!r} (static input scales) is not "
                     "implemented; only 'dynamic'")
    if qc.get("dequantize"):
        raise refuse(source, "dequantize true is not supported (streamer runs the float8 weights as stored)")
    if qc.get("modules_to_convert"):
        raise refuse(source, f"modules_to_convert {qc['modules_to_convert']!r} (float8 embeddings) is not supported")
    if qc.get("scale_fmt") not in (None, "float"):
        raise refuse(source, f"scale_fmt {qc['scale_fmt']!r} is not supported (fp32 scales only)")
    if qc.get("expert_dtype") not in (None, "fp8"):
        raise refuse(source, f"expert_dtype {qc['expert_dtype']!r} is not supported")
    skip = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()) + ("lm_head",)
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", "tensor", "token", None, skip)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise refuse(source, f"weight_block_size {block!r} is not two positive integers")
    return Fp8Scheme("fp8", "block", "group", (block[0], block[1]), skip)


def ct_group(qc: dict, source: str, kind: str) -> tuple[str, dict, str | None]:
    """A compressed-tensors config's one quantization group, checked as far as the float8
    and int4 (int4_checkpoint.py) readers share it: (where, the group, its format)."""
    unknown = sorted(set(qc) - CT_FIELDS)
    if unknown:
        raise refuse(source, f"field {unknown[0]!r} is not understood (compressed-tensors)")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(field):
            raise refuse(source, f"{field} is not supported (compressed-tensors)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(source, f"has {len(groups)} config_groups; one {kind} group is supported")
    (name, group), = groups.items()
    where = f"config_groups.{name}"
    unknown = sorted(set(group) - CT_GROUP_FIELDS)
    if unknown:
        raise refuse(source, f"{where} field {unknown[0]!r} is not understood")
    return where, group, group.get("format") or qc.get("format")


def _compressed_tensors(qc: dict, source: str) -> Fp8Scheme:
    where, group, fmt = ct_group(qc, source, "float8")
    if fmt not in CT_FORMATS:
        raise refuse(source, f"format {fmt!r} is not supported (compressed-tensors {' or '.join(CT_FORMATS)})")
    if group.get("output_activations"):
        raise refuse(source, f"{where}.output_activations is not supported")
    w = group.get("weights") or {}
    _check_args(w, f"{where}.weights", source)
    if w.get("dynamic"):
        raise refuse(source, f"{where}.weights dynamic {w['dynamic']!r} is not supported")
    strategy = w.get("strategy")
    block: tuple[int, int] | None = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise refuse(source, f"{where}.weights block_structure {bs!r} is not two positive integers")
        block = (bs[0], bs[1])
    elif strategy not in ("tensor", "channel"):
        raise refuse(source, f"{where}.weights strategy {strategy!r} is not supported (tensor, channel or block)")
    a = group.get("input_activations")
    if not a:
        raise refuse(source, f"{where} has no input_activations: weight-only float8 is not implemented")
    _check_args(a, f"{where}.input_activations", source)
    if a.get("dynamic") is not True:
        raise refuse(source, f"{where}.input_activations dynamic {a.get('dynamic')!r} (static input scales) is not "
                     "implemented; only dynamic")
    act = a.get("strategy")
    if block is None and act not in ("token", "tensor"):
        raise refuse(source, f"{where}.input_activations strategy {act!r} with {strategy} weight scales is not "
                     "supported (token or tensor)")
    if block is not None and not (act == "group" and a.get("group_size") == block[1]):
        raise refuse(source, f"{where}.input_activations strategy {act!r} (group_size {a.get('group_size')!r}) with "
                     f"block weights is not supported (group, group_size {block[1]})")
    targets = ct_targets(group, where, source)
    return Fp8Scheme("compressed-tensors", strategy, act, block, tuple(qc.get("ignore") or ()), targets)


def ct_args(args: dict, where: str, source: str, kind: str, bits: int, supported: str) -> None:
    """A compressed-tensors group's weights or activations arguments: every field understood, and
    of the type and bits this reader takes (kind "float" or "int"; supported: the refusal's hint)."""
    unknown = sorted(set(args) - CT_ARGS_FIELDS)
    if unknown:
        raise refuse(source, f"{where} field {unknown[0]!r} is not understood")
    if args.get("type") != kind or args.get("num_bits") != bits:
        raise refuse(source, f"{where} type {args.get('type')!r} with num_bits {args.get('num_bits')!r} is not "
                     f"supported ({supported})")


def ct_targets(group: dict, where: str, source: str) -> tuple[str, ...]:
    """The group's targets: 'Linear' or 're:' patterns (kept for Scheme.quantized)."""
    targets = tuple(group.get("targets") or ())
    if not targets or any(t != "Linear" and not t.startswith("re:") for t in targets):
        raise refuse(source, f"{where}.targets {list(targets)!r} is not supported ('Linear' or 're:' patterns)")
    return targets


def _check_args(args: dict, where: str, source: str) -> None:
    ct_args(args, where, source, "float", 8, "float8 only: type 'float', num_bits 8")
    if args.get("symmetric", True) is not True:
        raise refuse(source, f"{where} symmetric false (zero points) is not supported")
