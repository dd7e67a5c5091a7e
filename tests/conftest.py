"""Test-wide setup.

Triton kernels run on CPU only in interpreter mode, and TRITON_INTERPRET must be set before
any `@triton.jit` decorator runs, so it is set here, before test modules import kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
