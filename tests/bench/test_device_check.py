"""``bench/device_check.py --dry-run``: the GPU check end to end on the CPU (Triton's interpreter, tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the device check runs Triton kernels (the test extra has triton)")
pytest.importorskip("transformers", reason="the device check compares with transformers (the test extra)")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_check.py"


@pytest.mark.timeout(600)
def test_dry_run_checks_every_section_and_writes_one_json(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    s = data["sections"]
    assert data["dry_run"] and s["env"]["backend"] == "triton" and s["env"]["interpreter"]
    assert not [k for k, v in s.items() if "error" in v or "skipped" in v], {k: v.get("error") for k, v in s.items()}
    for name in ("gemm", "attention", "models"):  # every kernel and model equal to its reference
        checks = {k: v for k, v in s[name].items() if isinstance(v, dict)}
        assert checks and all(v.get("ok") for v in checks.values()), (name, checks)
    assert set(s["models"]) >= {"llama", "qwen2", "gemma3"}
    tiny = s["speed"]["tiny"]
    assert tiny["int8"]["batch2"]["decode_tok_s"] > 0 and tiny["peer"]["batch1"]["decode_tok_s"] > 0
    assert "triton gemm_blocks" in json.dumps(tiny["int8"]["device"]["linear"])
    opt = s["optimize"]  # optimize on the device: the baseline measured, what has no GPU kernel skipped with why
    assert opt["ok"] and opt["device"]["backend"] == "triton" and opt["records"]["baseline"]
    assert {x["label"] for x in opt["device"]["skipped"]} == {"w=sparse50 kv=auto", "w=as loaded kv=kivi4"}
    assert "gemm " in r.stdout and "optimize   ok" in r.stdout and "wrote" in r.stdout  # the table
