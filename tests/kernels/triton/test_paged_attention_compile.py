"""The Triton paged attention compiled ahead of time for an H100/H200 (sm_90) with triton's own ptxas, no GPU: the
interpreter accepts code the compiler refuses (globals that are not constexpr, shared memory beyond the chip's
228 KiB). In a subprocess: triton must be imported without TRITON_INTERPRET to compile."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")
pytest.importorskip("triton.backends.nvidia", reason="triton has no CUDA backend here")

SCRIPT = """
import json
from bytediet.kernels.triton.paged_attention_check import compile_for
print(json.dumps(compile_for(90, [("turboquant", "q4_0", False, 4, 128), ("q5_0", "turboquant", True, 4, 128)])))
"""


def test_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    src = os.path.join(os.path.dirname(__file__), "..", "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(cases) == 2 and all(c["shared"] <= 227 * 1024 for c in cases), cases
