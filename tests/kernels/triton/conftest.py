"""Triton kernels run in the interpreter on a machine without CUDA (on one with CUDA they are compiled for it).
Triton builds its own @jit helpers (tl.sum, …) for the interpreter only when it is imported with TRITON_INTERPRET=1,
so the variable is set around that import here, then per test of this directory by a fixture: it does not leak into
other directories."""
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
    if not INTERPRET:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tl = pytest.importorskip("triton.language", reason="triton is not installed")
    if type(tl.sum).__name__ == "JITFunction":
        pytest.fail("triton was imported for a GPU before tests/kernels/triton/conftest.py could import it for the "
                    "interpreter: set TRITON_INTERPRET=1 before anything imports triton")
