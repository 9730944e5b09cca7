"""The STREAMER_ environment variables are read in streamer/env.py alone, each checked: a value the
engine cannot use is a ConfigError naming the variable."""

import pytest

from streamer.env import blas_library, env_flag, gemv_preload_columns, l2_prefetch_bytes, pdl_mode
from streamer.errors import ConfigError


def test_the_blas_library_is_torchs_default_unless_one_is_named(monkeypatch):
    monkeypatch.delenv("STREAMER_BLAS", raising=False)
    assert blas_library() is None
    monkeypatch.setenv("STREAMER_BLAS", " cuBLASLt ")
    assert blas_library() == "cublaslt"
    monkeypatch.setenv("STREAMER_BLAS", "mkl")
    with pytest.raises(ConfigError, match="STREAMER_BLAS must be one of cublas, cublaslt"):
        blas_library()


def test_a_flag_is_off_only_when_it_says_so(monkeypatch):
    for value, want in (("0", False), ("off", False), ("No", False), ("1", True), ("yes", True), ("", True)):
        monkeypatch.setenv("STREAMER_PDL", value)
        assert env_flag("PDL", True) is want


def test_pdl_is_on_off_or_early(monkeypatch):
    """STREAMER_PDL: kernels.common's PDL_ON (1) by default, PDL_OFF (0) when off, PDL_EARLY (2) for "early"."""
    for value, want in (("", 1), ("1", 1), ("off", 0), ("0", 0), ("early", 2), (" Early ", 2)):
        monkeypatch.setenv("STREAMER_PDL", value)
        assert pdl_mode() == want, value


def test_the_l2_prefetch_is_off_a_default_or_a_byte_count(monkeypatch):
    for value, want in (("", 0), ("0", 0), ("1", 2048), ("on", 2048), ("65536", 65536)):
        monkeypatch.setenv("STREAMER_L2_PREFETCH", value)
        assert l2_prefetch_bytes() == want, value


def test_the_gemv_preload_is_a_column_count(monkeypatch):
    monkeypatch.delenv("STREAMER_GEMV_PRELOAD", raising=False)
    assert gemv_preload_columns() == 0
    monkeypatch.setenv("STREAMER_GEMV_PRELOAD", "2048")
    assert gemv_preload_columns() == 2048
    monkeypatch.setenv("STREAMER_GEMV_PRELOAD", "lots")
    with pytest.raises(ConfigError, match="STREAMER_GEMV_PRELOAD must be a number of columns"):
        gemv_preload_columns()
