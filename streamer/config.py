"""Every knob of the engine and the server, in one place.

Environment variables are read here and only here, with the STREAMER_ prefix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from streamer.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8",)


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where converted models live: flag > STREAMER_CACHE_DIR > ~/.cache/streamer."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("STREAMER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "streamer"


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    """A local HF folder, or "default" for SmolLM2-135M-Instruct (fetched once)."""
    dtype: str = "auto"
    """auto: bfloat16 on CUDA, float32 on CPU."""
    kv_cache_dtype: str = "auto"
    """auto: the model's dtype. fp8 (or fp8_e4m3): K/V stored as float8 e4m3 with scale 1,
    saturated at +-448; half the bytes per token (twice the tokens in the pool, half the
    attention reads of long contexts) for a small loss of precision."""
    quantization: str | None = None
    """fp8: the decoder's linear layers hold float8 e4m3 weights (a scale per output row,
    computed at load time) and quantize their inputs per token at each call (W8A8, see
    streamer/model/quant.py): half the weight bytes and twice the tensor-core FLOPs, for a
    small loss of precision. None: the weights stay in `dtype`."""
    device: str = "auto"
    load_format: str = "auto"
    """auto: safetensors from the folder; dummy: random weights of the real shapes."""
    cache_dir: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    """Fixed pool size; None sizes it from gpu_memory_fraction / cpu_kv_bytes."""
    gpu_memory_fraction: float = 0.85
    cpu_kv_bytes: int = 512 << 20
    max_num_seqs: int = 256
    """Cap on requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    max_model_len: int | None = None
    """Defaults to the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    overlap_schedule: bool | None = None
    """Schedule batch N+1 while N runs. None: on for CUDA, off on CPU (nothing to overlap)."""
    hold_ahead_ms: float = 1.5
    """With overlap, while only decodes run and nobody waits, the batch after the running
    one is scheduled this long before the running one is expected to end (not at once), so
    that a request arriving meanwhile joins it instead of queueing behind it. 0: off."""
    decode_gemv: bool = True
    """On CUDA, linear layers of one-token steps use the Triton GEMV of kernels/gemv.py
    (cuBLAS leaves bandwidth unused on mid-size weights at batch 1)."""
    cuda_graph_max_bs: int = 512
    """Largest decode batch replayed from a CUDA graph (capped at max_num_seqs; larger decode
    batches run eagerly, their host launches then bound the step: W3 at batch ~490 ran 7%
    faster with graphs up to 512 than up to 256)."""
    cuda_graph_max_tokens: int = 2048
    """Largest prefill or mixed step replayed from a CUDA graph (padded up a ladder of
    token counts); longer steps run eagerly, where the GPU outlasts the launches. 0: off."""
    warmup: bool = True
    """On CUDA, start() runs a few short requests first (Triton compiles its kernel variants)."""
    seed: int = 0
    fcfs_queue_threshold: int = 128
    """Past this many waiting requests, admission is plain FCFS (no prefix sort)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} (or none), not {self.quantization!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be auto or dummy, not {self.load_format!r}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, not {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages must be >= 2, not {self.num_pages}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"gpu_memory_fraction must be in (0, 1], not {self.gpu_memory_fraction}")
        if self.hold_ahead_ms < 0:
            raise ConfigError(f"hold_ahead_ms must be >= 0, not {self.hold_ahead_ms}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_queue: int = 1024
    """Waiting requests beyond this are answered 503 with Retry-After."""
    session_idle_timeout: float = 600.0
    engine_process: bool | None = None
    """`streamer serve` runs the engine in a process of its own (engine/remote.py): the
    server's HTTP/SSE work and the engine's actors do not share one event loop and GIL.
    None: a process of its own when the engine runs on CUDA (where the GPU waits whenever
    the host falls behind), in the server's process on CPU (where the model's compute
    takes the cores, and a second process would only add its ~350 MB)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
