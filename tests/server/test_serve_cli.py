"""``bytediet serve``: its flags, and one real process with the default model answering over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from bytediet.cli import build_parser, main
from tests.server.conftest import parse_sse
from tests.server.test_disconnect import free_port


def test_defaults_bind_loopback_and_take_engine_flags():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.served_model_name) == ("127.0.0.1", 8000, "default", None)
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "gemma3-270m",
            "--served-model-name",
            "g",
            "g2",
            "--kv-cache-dtype",
            "int8",
            "--max-num-seqs",
            "4",
            "--port",
            "9001",
        ]
    )
    assert args.served_model_name == ["g", "g2"] and args.kv_cache_dtype == "int8" and args.max_num_seqs == 4
    assert not args.engine_process and build_parser().parse_args(["serve", "--engine-process"]).engine_process


def test_bad_port_is_a_user_error(capsys):
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_port_clash_fails_before_the_start_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err and "serving" not in err


def test_server_flags_become_the_server_config(monkeypatch):
    from bytediet.commands.serve import server_config

    monkeypatch.setenv("BYTEDIET_API_KEY", "from-env")
    args = build_parser().parse_args(
        [
            "serve",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--max-body-bytes",
            "1MiB",
            "--allowed-origins",
            "http://x",
            "--max-model-len",
            "512",
            "--shutdown-timeout",
            "5",
        ]
    )
    config = server_config(args)
    assert config.api_keys == ("a", "b", "from-env") and config.max_body_bytes == 2**20
    assert config.allowed_origins == ("http://x",) and config.max_model_len == 512 and config.shutdown_timeout == 5
    monkeypatch.delenv("BYTEDIET_API_KEY")
    assert server_config(build_parser().parse_args(["serve"])).api_keys == ()


@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_real_process_serves_the_default_model(mode):
    port = free_port()
    log = tempfile.TemporaryFile()
    cmd = [
        sys.executable,
        "-m",
        "bytediet.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--kv-cache-memory",
        "64MiB",
        "--served-model-name",
        "smol",
        mode,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"bytediet serve exited early: {_read(log)}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        else:
            pytest.fail(f"bytediet serve did not come up within 120 s: {_read(log)}")
        with httpx.Client(base_url=base, timeout=60) as c:
            r = c.post(
                "/v1/completions",
                json={"model": "smol", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"].strip(), body
            assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
            s = c.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 3,
                    "temperature": 0,
                    "stream": True,
                },
            )
            events = parse_sse(s.text)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    # drained, the app's lifespan stops the engine, and the process exits normally (no re-raised SIGTERM)
    assert proc.returncode == 0, _read(log)


def _read(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]
