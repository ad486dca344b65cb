"""Whether Triton kernels can run here, without importing triton at bytediet's import."""

from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton runs its kernels in the interpreter (TRITON_INTERPRET=1: CPU tensors, one program at a time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """True when triton is installed and can run: a CUDA device, or the interpreter (TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreting() or torch.cuda.is_available()
