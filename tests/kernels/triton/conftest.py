"""Triton kernels run in the interpreter on a machine without CUDA (on one with CUDA they are compiled for it).
Triton builds its own jit'd helpers for the interpreter when it is imported with TRITON_INTERPRET=1, so the variable
is set for that import only, then per test of this directory by a fixture: it does not leak into other directories."""
import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        if _before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _before


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
