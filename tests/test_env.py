"""The STREAMER_ environment variables are read in streamer/env.py alone, each checked: a value the
engine cannot use is a ConfigError naming the variable."""

import pytest

from streamer.env import blas_library, env_flag
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
