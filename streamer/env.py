"""The environment: the engine reads its STREAMER_ variables here and only here, through the
typed accessors below (env_str, env_flag, env_ints):

  STREAMER_CACHE_DIR       cache_dir(): where converted models live
  STREAMER_STEP_TRACE      DiagnosticsConfig.step_trace: a JSON line per step to this file
  STREAMER_PROFILE_STEPS   DiagnosticsConfig.profile_steps: steps run under torch.profiler...
  STREAMER_PROFILE_OUT     ...their kernel tables go to this file (kernel_profile.jsonl)
  STREAMER_LOG_COMPILES    DiagnosticsConfig.log_compiles: log each Triton variant built
  STREAMER_PDL             use_pdl(): programmatic dependent launch on sm_90+ (default on)
  STREAMER_L2_PREFETCH     use_l2_prefetch(): decode GEMVs ask L2 for weights before their PDL wait (default off)
  STREAMER_DUMMY_INIT      dummy_init(): the values of load_format="dummy" weights (normal, or uniform as vLLM's)
  STREAMER_BLAS            blas_library(): which cuBLAS library torch's GEMMs prefer (default: torch's choice)
  MASTER_ADDR, MASTER_PORT rendezvous_env(): node 0 of a multi-node tensor-parallel engine
                           (torch.distributed's standard names, unprefixed)

(TRITON_INTERPRET is Triton's own switch, not ours: kernels/common.py reads it.)
"""

from __future__ import annotations

import os
from pathlib import Path

from streamer.errors import ConfigError

ENV_PREFIX = "STREAMER_"
_OFF = ("0", "false", "off", "no")


def env_str(name: str, default: str = "") -> str:
    """STREAMER_<name>, stripped; `default` when unset or empty."""
    return os.environ.get(ENV_PREFIX + name, "").strip() or default


def env_flag(name: str, default: bool) -> bool:
    """STREAMER_<name> as a switch: 0, false, off, no (any case) turn it off, any other
    value on; unset or empty: `default`."""
    value = env_str(name)
    return default if not value else value.lower() not in _OFF


def env_ints(name: str) -> frozenset[int]:
    """STREAMER_<name> as comma-separated integers ("40,41,900"); unset: none."""
    return frozenset(int(s) for s in env_str(name).split(",") if s.strip())


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where converted models live: flag > STREAMER_CACHE_DIR > ~/.cache/streamer."""
    if override:
        return Path(override).expanduser()
    env = env_str("CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "streamer"


def use_pdl() -> bool:
    """STREAMER_PDL (default on): launch the Triton kernels with programmatic dependent launch
    where the GPU has it (sm_90+). The model runner hands it to kernels.common.PDL (kernels/
    does not import streamer); 0 turns it off, to measure what it gains."""
    return env_flag("PDL", True)


def use_l2_prefetch() -> bool:
    """STREAMER_L2_PREFETCH (default off): 1 makes the decode GEMVs, the float8 GEMM and the MoE
    router ask L2 for their first weight bytes before their PDL wait (kernels.common.PREFETCH_BYTES).
    Off: it gained nothing measured (benchmarks/RESULTS.md, thirty-seventh session)."""
    return env_flag("L2_PREFETCH", False)


DUMMY_INITS = ("normal", "uniform")


def dummy_init() -> str:
    """STREAMER_DUMMY_INIT: the values of load_format="dummy" weights. normal (default): N(0, 0.02),
    norms at their neutral weight. uniform: vLLM 0.26.0's, to compare on its values: every floating
    weight U(-1e-3, 1e-3), each drawn from the seed anew (weights of one shape are equal)."""
    value = env_str("DUMMY_INIT", "normal").lower()
    if value not in DUMMY_INITS:
        raise ConfigError(f"STREAMER_DUMMY_INIT must be one of {', '.join(DUMMY_INITS)}, got {value!r}")
    return value


BLAS_LIBRARIES = ("cublas", "cublaslt")


def blas_library() -> str | None:
    """STREAMER_BLAS: cublas or cublaslt, the library torch's bf16 GEMMs prefer (the model runner sets
    torch.backends.cuda.preferred_blas_library); unset: torch's default. Another pick of kernels by
    shape: at 513 rows (a 512-token prompt beside one decode) cuBLASLt's step took 13.68 ms against
    14.06 (benchmarks/RESULTS.md, thirty-ninth session); what it does at other shapes is unmeasured."""
    value = env_str("BLAS").lower()
    if value and value not in BLAS_LIBRARIES:
        raise ConfigError(f"STREAMER_BLAS must be one of {', '.join(BLAS_LIBRARIES)}, got {value!r}")
    return value or None


def rendezvous_env() -> tuple[str | None, int | None]:
    """(MASTER_ADDR, MASTER_PORT): where the ranks of a multi-node engine meet."""
    port = os.environ.get("MASTER_PORT", "").strip()
    return os.environ.get("MASTER_ADDR", "").strip() or None, int(port) if port else None
