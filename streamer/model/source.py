"""What a `--model` value names, and the HF folder it comes down to.

Three kinds, told apart here and only here (the engine, the CLI and the benchmarks ask):
"default" (SmolLM2-135M-Instruct, fetched once: default_model.py), a GGUF file (a path
ending in .gguf, or any file: converted once into the cache, gguf.py), or a local HF folder.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT = "default"


def is_gguf(model: str) -> bool:
    """A file, or a path ending in .gguf that is not a folder (a missing file is still one:
    the error then says that no such GGUF file exists, not that a folder is missing)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return False
    return path.is_file() or path.suffix.lower() == ".gguf"


def resolve_model(model: str, cache_dir: str | None = None, log=print) -> Path:
    """The HF folder to load: fetched or converted first where it must be."""
    if model == DEFAULT:
        from streamer.model.default_model import ensure_default_model

        return ensure_default_model(cache_dir, log)
    if is_gguf(model):
        from streamer.model.gguf import ensure_converted

        return ensure_converted(model, cache_dir, log)
    return Path(model).expanduser()


def model_name(model: str) -> str:
    """The name the server answers to: "default", a GGUF file's name less .gguf, a folder's name."""
    if model == DEFAULT:
        return DEFAULT
    path = Path(model).expanduser()
    return path.stem if is_gguf(model) and path.suffix.lower() == ".gguf" else path.name
