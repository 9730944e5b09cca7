"""Which devices each data-parallel replica gets: the environment its engine process starts with.

On CUDA, replica i sees only its own devices (CUDA_VISIBLE_DEVICES, set before its process
starts, so it never touches another replica's GPU and needs no device index of its own):
tensor_parallel_size of them (1 without tensor parallelism), taken in order from the
devices this process may use (its own CUDA_VISIBLE_DEVICES, or all). On the CPU the
replicas share the cores: each gets an equal share of torch's threads (OMP_NUM_THREADS,
unless it is set), so that N replicas do not run N x cores threads.
"""

from __future__ import annotations

import os

from streamer.config import EngineConfig
from streamer.errors import ConfigError


def on_cuda(config: EngineConfig) -> bool:
    if config.device == "auto":
        import torch  # noqa: PLC0415 - heavy; is_available() creates no CUDA context

        return torch.cuda.is_available()
    return config.device.startswith("cuda")


def _visible() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch  # noqa: PLC0415

    return [str(i) for i in range(torch.cuda.device_count())]


def replica_environments(config: EngineConfig, size: int) -> list[dict[str, str]]:
    """The environment variables of each replica's engine process (ConfigError: too few devices)."""
    if size < 1:
        raise ConfigError(f"data_parallel_size must be >= 1, not {size}")
    if not on_cuda(config):
        if "OMP_NUM_THREADS" in os.environ:
            return [{} for _ in range(size)]
        threads = max(1, (os.cpu_count() or 1) // size)
        return [{"OMP_NUM_THREADS": str(threads)} for _ in range(size)]
    if config.device not in ("auto", "cuda"):
        raise ConfigError(f"--device {config.device} names one device, and each of the {size} data-parallel "
                          "replicas takes its own: give --device cuda (or auto), and CUDA_VISIBLE_DEVICES to "
                          "choose the devices")
    tp = int(getattr(config, "tensor_parallel_size", 1) or 1)
    devices = _visible()
    need = size * tp
    if len(devices) < need:
        per = f" x tensor_parallel_size {tp}" if tp > 1 else ""
        raise ConfigError(f"data_parallel_size {size}{per} needs {need} CUDA devices, and {len(devices)} "
                          f"are visible ({','.join(devices) or 'none'})")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[i * tp : (i + 1) * tp])} for i in range(size)]
