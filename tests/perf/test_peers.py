"""The llama.cpp peer's crash probe: a native crash in a child process turns llama.cpp's extra buffer types off."""

from __future__ import annotations

import sys
import types

import pytest

import bytediet.perf.peers as peers


@pytest.mark.parametrize(
    "body, expected, note",
    [
        ("pass", True, ""),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", False, "signal 11"),
        ("raise SystemExit(3)", False, "exit code 3"),
    ],
)
def test_probe_reports_how_the_child_ended(monkeypatch, tmp_path, body, expected, note):
    monkeypatch.setattr(peers, "_PROBE", body)
    use, why = peers.probe_llama_cpp_extra_buffer_types(tmp_path / "model.gguf", threads=1)
    assert use is expected and note in why
    if not use:
        assert "use_extra_bufts = False" in why


def test_probe_timeout_turns_them_off(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "_PROBE", "import time; time.sleep(30)")
    use, why = peers.probe_llama_cpp_extra_buffer_types(tmp_path / "m.gguf", threads=1, timeout_s=0.5)
    assert use is False and "timed out" in why


def test_model_params_are_patched_only_inside_the_context(monkeypatch):
    class Params:
        use_extra_bufts = True

    low = types.SimpleNamespace(llama_model_default_params=lambda: Params())
    fake = types.ModuleType("llama_cpp.llama")
    fake.llama_cpp = low
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama", fake)
    sys.modules["llama_cpp"].llama = fake
    with peers._llama_cpp_model_params(use_extra_bufts=False):
        assert low.llama_model_default_params().use_extra_bufts is False
    assert low.llama_model_default_params().use_extra_bufts is True
