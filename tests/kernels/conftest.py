"""Kernel tests run the Triton kernels through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported: `triton.jit`
decides between compiling and interpreting when a function is decorated, and
triton's own library functions (tl.sum, ...) are decorated at import time. If
an earlier test module imported triton without it, tests/kernels/device.py (which
every kernel test imports) stops with a reason (run tests/kernels alone, or export
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
