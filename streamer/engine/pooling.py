"""How a model's prompt becomes one embedding (/v1/embeddings, LLM.embed), from the
sentence-transformers files of its folder where it has them: modules.json and the Pooling
module's config.json.

The engine computes one vector per prompt: the final hidden state (after the last norm) at
the prompt's last token (SamplingParams.embed). That is last-token pooling, which the decoder
embedding models use (Qwen3-Embedding, e5-mistral, gte-Qwen2, SFR-Embedding: their Pooling
config says pooling_mode_lasttoken). Then L2 normalization where modules.json lists a
Normalize module, and also for a folder without sentence-transformers files (as vLLM
normalizes a decoder's embeddings by default). A folder whose Pooling module asks for another
mode (mean, CLS, max, ...) or whose modules apply a Dense projection is served all the same
for generation; its embeddings are refused, naming what is missing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("streamer.pooling")

MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
ST = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooling:
    normalize: bool = True
    unsupported: str | None = None
    """Why this model's embeddings cannot be served (None: they can)."""


def pooling_config(model_path: Path) -> Pooling:
    """The pooling of a model folder (a GGUF file's folder is read the same way)."""
    folder = model_path if model_path.is_dir() else model_path.parent
    path = folder / "modules.json"
    if not path.is_file():
        return Pooling()
    try:
        modules = json.loads(path.read_text())
        types = [(m.get("type", ""), m.get("path", "")) for m in modules]
    except (OSError, ValueError, TypeError, AttributeError) as e:
        log.warning("%s cannot be read (%s): last-token pooling, normalized", path, e)
        return Pooling()
    normalize = any(t == ST + "Normalize" for t, _ in types)
    if any(t == ST + "Dense" for t, _ in types):
        return Pooling(normalize, "this model's sentence-transformers modules apply a Dense projection after "
                                  "pooling, which is not supported")
    pooling = next((p for t, p in types if t == ST + "Pooling"), None)
    if pooling is None:
        return Pooling(normalize)
    try:
        config = json.loads((folder / pooling / "config.json").read_text())
    except (OSError, ValueError) as e:
        log.warning("the Pooling module's config.json cannot be read (%s): last-token pooling", e)
        return Pooling(normalize)
    modes = [m for m in MODES if config.get(f"pooling_mode_{m}")]
    if modes and modes != ["lasttoken"]:
        return Pooling(normalize, f"this model's pooling ({', '.join(modes)}) is not supported: only last-token "
                                  "pooling (pooling_mode_lasttoken)")
    return Pooling(normalize)


def unit(v: list[float]) -> list[float]:
    """v scaled to length 1 (a zero vector stays zero)."""
    norm = sum(x * x for x in v) ** 0.5
    return [x / norm for x in v] if norm else list(v)
