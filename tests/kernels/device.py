"""Where the kernel tests run: compiled on CUDA when there is a GPU, else on CPU tensors
through the Triton interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET first)."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

CUDA = torch.cuda.is_available()
if not CUDA and not isinstance(tl.sum, InterpretedFunction):
    raise RuntimeError(
        "no GPU and triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it "
        "first): these kernels cannot be checked on CPU in this process"
    )
DEVICE = torch.device("cuda" if CUDA else "cpu")
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
