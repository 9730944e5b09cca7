"""SpeculativeConfig: EngineConfig.speculative_config (streamer/engine/spec/), parsed from a
dict or JSON text.

Unknown keys and methods are refused by name (ConfigError): a knob that is accepted is
implemented.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from streamer.errors import ConfigError

METHODS = ("ngram", "draft_model", "eagle3", "eagle")
"""ngram: prompt lookup (engine/spec/ngram.py); draft_model: a smaller model with the same
vocabulary proposes (model/draft.py); eagle3, eagle: an EAGLE-3 or EAGLE-1/2 head proposes
from the target's features (model/eagle_draft.py)."""
_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "exact_verify",
              "disable_by_batch_size"),
    "draft_model": ("method", "model", "num_speculative_tokens", "disable_by_batch_size"),
    "eagle3": ("method", "model", "num_speculative_tokens", "disable_by_batch_size"),
    "eagle": ("method", "model", "num_speculative_tokens", "disable_by_batch_size"),
}
_OTHER_METHODS = {
    "medusa": "Medusa heads are not supported",
    "mtp": "multi-token-prediction layers are not supported",
    "deepseek_mtp": "multi-token-prediction layers are not supported",
}


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Speculative decoding's settings. omit_defaults: serialized (the config the other
    tensor-parallel ranks receive) it names only the fields that differ from their defaults,
    which parse back for its method."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    """Proposed tokens per step at most (k): a verify step has 1 + k tokens per request."""
    prompt_lookup_min: int = 1
    """ngram: the shortest suffix of the sequence that is looked up in it."""
    prompt_lookup_max: int = 4
    """ngram: the longest; longer suffixes are tried first."""
    model: str | None = None
    """draft_model: what `--model` would name (a folder, a GGUF file or "default"); its
    vocabulary must be the target's. eagle3, eagle: the EAGLE head's folder (trained for this
    target)."""
    exact_verify: bool | None = None
    """ngram on CUDA: a lone request's verify step runs as decode rows that compute as plain
    batch-1 decoding does (model/exact_verify.py), so bf16 greedy output is plain greedy
    output also at ties; its GEMVs read the weights once per 4 verified rows (the extend step's
    GEMMs once). None: where it applies (up to MAX_EXACT_PROPOSALS proposals, one rank, a dense
    model, the decode GEMV and CUDA graphs on); True: required (refused where it cannot apply);
    False: never (one extend step). On CPU every verify is exact already (float32)."""


    disable_by_batch_size: int | None = None
    """No proposals in a step while this many requests or more are running (their verify
    steps would cost more than they save once the batch is compute-bound); None: always."""

    @property
    def drafted(self) -> bool:
        """Whether the proposals are drawn on the device by a draft (draft_model, eagle3): the
        scheduler sends PLACEHOLDERs, and the draft's KV shares the target's page ids."""
        return self.method in ("draft_model", "eagle3", "eagle")


MAX_EXACT_PROPOSALS = 15
"""exact_verify: most proposals (a verify of 1 + k rows, kernels.gemv.config.MAX_ROWS_PER_ROW)."""


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict, or JSON text of one -> SpeculativeConfig (or None)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"speculative_config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a JSON object, not {type(value).__name__}")
    method = value.get("method", "ngram")
    if method in _OTHER_METHODS:
        raise ConfigError(f"speculative_config method {method!r}: {_OTHER_METHODS[method]}")
    if method not in METHODS:
        raise ConfigError(f"speculative_config method must be one of {', '.join(METHODS)}, not {method!r}")
    unknown = sorted(set(value) - set(_KEYS[method]))
    if unknown:
        raise ConfigError(f"unknown speculative_config key(s) for method {method!r}: {', '.join(unknown)}")
    try:
        cfg = msgspec.convert(value, SpeculativeConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(f"speculative_config: {e}") from None
    if not 1 <= cfg.num_speculative_tokens <= 64:
        raise ConfigError(f"speculative_config num_speculative_tokens must be in [1, 64], not {cfg.num_speculative_tokens}")
    if cfg.method == "draft_model" and not (isinstance(cfg.model, str) and cfg.model):
        raise ConfigError("speculative_config method 'draft_model' needs 'model': the draft model's folder or file")
    if cfg.method in ("eagle3", "eagle") and not (isinstance(cfg.model, str) and cfg.model):
        raise ConfigError(f"speculative_config method {cfg.method!r} needs 'model': the EAGLE head's folder")
    if cfg.exact_verify and cfg.num_speculative_tokens > MAX_EXACT_PROPOSALS:
        raise ConfigError(f"speculative_config exact_verify takes at most {MAX_EXACT_PROPOSALS} "
                          f"num_speculative_tokens, not {cfg.num_speculative_tokens}")
    if cfg.disable_by_batch_size is not None and cfg.disable_by_batch_size < 1:
        raise ConfigError(f"speculative_config disable_by_batch_size must be at least 1, not {cfg.disable_by_batch_size}")
    if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
        raise ConfigError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, not "
                          f"{cfg.prompt_lookup_min} and {cfg.prompt_lookup_max}")
    return cfg
