"""The model's own sampling defaults, from its folder's generation_config.json.

  generation_defaults(folder) -> {"temperature": 0.7, "top_p": 0.8, ...}   (those it gives)

A model's authors set these for it (Qwen3: temperature 0.6, top_p 0.95, top_k 20), and a
request that omits a parameter gets the model's value rather than streamer's (`streamer
serve --generation-config none` keeps streamer's: temperature 1, no top_p / top_k / min_p,
no repetition penalty). Only the five parameters that mean the same in transformers and
here are read: temperature, top_p, top_k, repetition_penalty, min_p. Not read:
  - do_sample: many files say false (transformers' default, not a choice) next to the
    values meant for sampling, and the server's API has no such switch: temperature 0 is greedy;
  - max_new_tokens / max_length: a budget for transformers' generate, not an API default
    (OpenAI's are 16 for completions and the context's room for chat).
A value this server would refuse in a request (top_p 0, a negative temperature) is left
out, so that a bad file cannot make every request fail; top_k 0 is transformers' "off",
which is -1 here.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("streamer.engine")

VALID: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: 0 <= v <= 2,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v == -1 or v >= 1,
    "repetition_penalty": lambda v: 0 < v <= 10,
    "min_p": lambda v: 0 <= v <= 1,
}
"""The parameters read, and the values a request may give them (server/protocol.py's ranges)."""


def sampling_defaults(config: Mapping[str, Any]) -> dict[str, float]:
    """The sampling defaults of a generation config (its JSON object), by SamplingFields name."""
    out: dict[str, float] = {}
    for name, valid in VALID.items():
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            log.warning("generation_config.json: %s = %r is not a number; not used", name, value)
            continue
        if name == "top_k":
            if value != int(value):
                log.warning("generation_config.json: top_k = %r is not an integer; not used", value)
                continue
            value = -1 if value == 0 else int(value)
        if not valid(value):
            log.warning("generation_config.json: %s = %r is out of range; not used", name, value)
            continue
        out[name] = value
    return out


def generation_defaults(folder: Path) -> dict[str, float]:
    """The sampling defaults of a model folder (none without a readable generation_config.json)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s cannot be read (%s): no generation defaults", path, e)
        return {}
    return sampling_defaults(config) if isinstance(config, dict) else {}
