"""The weight kernels compile for a real GPU target (sm_90) on this CPU: one layout per kernel family, in a process
of its own (the kernels here are defined for the interpreter)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_for_gpu.py")


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="this triton has no NVIDIA backend to compile with",
)
def test_kernels_compile_for_sm90():
    # Q4_0 (runs), Q6_K (kquants), SPARSE24_INT8 (sparse24 GEMV, per-element GEMM), INT4-g128 (runs, its geometry)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(Path(__file__).parents[3] / "src"))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90", "2", "14", "109", "103"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
