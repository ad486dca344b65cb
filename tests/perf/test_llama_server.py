"""The llama-server peer: request bodies, stream parsing (against a fake SSE server), the missing-binary path,
the llama.cpp peer's hand-off of the concurrency sweep, and one real run when the binary is built."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import bytediet.perf.llama_server as ls
from bytediet.errors import ConfigError
from bytediet.perf.bench import BenchConfig, BenchContext, RequestTiming, Unavailable, run_system
from bytediet.perf.peers import LlamaCppPeer, make_peers


# ----------------------------------------------------------------------------------- requests
def test_completion_body_forces_exactly_max_tokens_greedily():
    body = ls.completion_body((5, 6, 7), 9)
    assert body == {
        "prompt": [5, 6, 7],
        "n_predict": 9,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": False,
        "seed": 0,
    }
    sampled = ls.completion_body("Emma", 4, temperature=0.8, cache_prompt=True)
    assert sampled["prompt"] == "Emma" and "top_k" not in sampled and sampled["cache_prompt"] is True


def test_server_command_gives_every_slot_its_context():
    cmd = ls.server_command(Path("/bin/llama-server"), Path("m.gguf"), port=1234, threads=2, slots=16, ctx_per_slot=512)
    flag = {a: b for a, b in zip(cmd, cmd[1:])}
    assert flag["-np"] == "16" and flag["-c"] == str(16 * 512) and flag["-t"] == flag["-tb"] == "2"
    assert flag["--host"] == "127.0.0.1" and flag["--port"] == "1234" and flag["-cram"] == "0"
    assert "--cont-batching" in cmd and "--metrics" in cmd
    assert "-cram" not in ls.server_command(
        Path("s"), Path("m"), port=1, threads=1, slots=1, ctx_per_slot=256, prompt_cache=True
    )


@pytest.mark.parametrize(
    "line, expected",
    [
        ('data: {"content": "Hi", "tokens": [17, 18], "stop": false}', ls.StreamEvent(tokens=2, text="Hi")),
        (b'data: {"content": "", "tokens": [200], "stop": false}\n', ls.StreamEvent(tokens=1)),  # half a character
        ('data: {"content": "", "tokens": [], "stop": true, "tokens_predicted": 3}', ls.StreamEvent(stop=True)),
        ('data: {"content": "x", "stop": false}', ls.StreamEvent(tokens=1, text="x")),  # without return_tokens
        ("data: [DONE]", ls.StreamEvent(stop=True)),
        (
            'data: {"error": {"code": 500, "message": "no slot", "type": "server_error"}}',
            ls.StreamEvent(stop=True, error="no slot"),
        ),
        ("", None),
        (": ping", None),
        ("event: message", None),
    ],
)
def test_parse_stream_line(line, expected):
    assert ls.parse_stream_line(line) == expected


# ----------------------------------------------------------------------------------- a fake server
class _Fake(BaseHTTPRequestHandler):
    """Streams ``n_predict`` one-token events (``short`` fewer), or an error event, with ``delay`` between."""

    short, error, delay = 0, False, 0.01

    def do_POST(self):  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if self.error:
            self.wfile.write(b'data: {"error": {"message": "context full"}}\n\n')
            return
        for i in range(body["n_predict"] - self.short):
            time.sleep(self.delay)
            self.wfile.write(f"data: {json.dumps({'content': 'a', 'tokens': [i], 'stop': False})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b'data: {"content": "", "tokens": [], "stop": true}\n\n')

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    _Fake.short, _Fake.error = 0, False


def test_stream_completion_times_the_first_token_and_the_finish(fake_server):
    t0 = time.perf_counter()
    timing = ls.stream_completion(fake_server, ls.completion_body([1, 2, 3], 5), t0)
    assert timing.prompt_tokens == 3 and timing.output_tokens == 5
    assert 0.01 <= timing.ttft_s < timing.finish_s and timing.tpot_s >= 0.005


def test_stream_completion_rejects_short_streams_and_errors(fake_server):
    _Fake.short = 1
    with pytest.raises(ConfigError, match="returned 3 tokens, asked for exactly 4"):
        ls.stream_completion(fake_server, ls.completion_body([1], 4), time.perf_counter())
    _Fake.short, _Fake.error = 0, True
    with pytest.raises(ConfigError, match="context full"):
        ls.stream_completion(fake_server, ls.completion_body([1], 4), time.perf_counter())


# ----------------------------------------------------------------------------------- no binary
@pytest.fixture
def no_binary(monkeypatch, tmp_path):
    monkeypatch.delenv(ls.ENV_BINARY, raising=False)
    monkeypatch.setenv(ls.ENV_DIR, str(tmp_path / "empty"))


def test_missing_binary_says_how_to_build_it(no_binary, tmp_path, monkeypatch):
    path, why = ls.find_binary()
    assert path is None and ls.BUILD_SCRIPT in why and str(tmp_path / "empty") in why
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    [peer] = make_peers(["llama-server"], gguf, threads=1, n_ctx=256, pad_token_id=0)
    assert isinstance(peer, Unavailable) and peer.name == "llama-server" and ls.BUILD_SCRIPT in peer.reason
    monkeypatch.setenv(ls.ENV_BINARY, str(tmp_path / "nope"))
    assert ls.find_binary() == (None, f"${ls.ENV_BINARY}={tmp_path / 'nope'} is not an executable file")


def test_binary_is_found_in_the_build_cache(no_binary, tmp_path, monkeypatch):
    monkeypatch.setattr(ls, "llama_cpp_python_version", lambda: "9.9.9")
    binary = tmp_path / "empty" / "9.9.9" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert ls.find_binary() == (binary, "")


# ----------------------------------------------------------------------------------- the sweep hand-off
class _Recorder:
    def __init__(self, name: str) -> None:
        self.name, self.calls, self.closed = name, [], False

    def info(self) -> dict:
        return {"system": self.name, "concurrency_mode": f"{self.name} mode", "weights": "w"}

    def serve(self, prompts, max_tokens, concurrency):
        self.calls.append(concurrency)
        return [RequestTiming(len(p), n, 0.1, 0.1 + 0.01 * n) for p, n in zip(prompts, max_tokens)]

    def close(self) -> None:
        self.closed = True


def test_llama_cpp_peer_runs_the_sweep_on_llama_server():
    single, server = _Recorder("llama.cpp"), _Recorder("llama-server")
    peer = LlamaCppPeer(single, server)
    cfg = BenchConfig.quick(threads=1)
    ctx = BenchContext(cfg, list(range(2000)), "ids")
    out = run_system(peer, ctx, ["single", "concurrency"])
    assert server.calls == [1, *cfg.concurrency]  # its own warm-up, then one call per level
    assert set(single.calls) == {1}
    assert out["concurrency_system"] == {"system": "llama-server", "concurrency_mode": "llama-server mode"}
    assert out["info"]["concurrency_system"] == "llama-server"
    peer.close()
    assert single.closed and server.closed


def test_llama_cpp_peer_without_llama_server_stays_sequential():
    single = _Recorder("llama.cpp")
    peer = LlamaCppPeer(single, Unavailable("llama-server", "not built"))
    out = run_system(peer, BenchContext(BenchConfig.quick(threads=1), list(range(2000)), "ids"), ["concurrency"])
    assert out["concurrency_system"]["system"] == "llama.cpp"
    assert peer.info()["llama-server_unavailable"] == "not built"


def test_llama_cpp_peer_without_llama_cpp_python_runs_everything_on_llama_server():
    server = _Recorder("llama-server")
    peer = LlamaCppPeer(Unavailable("llama-cpp-python", "No module named 'llama_cpp'"), server)
    out = run_system(peer, BenchContext(BenchConfig.quick(threads=1), list(range(2000)), "ids"), ["single"])
    assert out["info"]["single_system"] == "llama-server" and server.calls
    with pytest.raises(ConfigError, match="not built"):
        LlamaCppPeer(Unavailable("llama-cpp-python", "missing"), Unavailable("llama-server", "not built"))


# ----------------------------------------------------------------------------------- the real binary
def test_real_llama_server_serves_exact_token_counts_in_parallel_slots():
    binary, why = ls.find_binary()
    if binary is None:
        pytest.skip(why)
    from bytediet.errors import CheckpointError
    from bytediet.models.loader import default_model_path

    try:
        gguf = default_model_path()
    except CheckpointError as exc:
        pytest.skip(str(exc))
    peer = ls.LlamaServerSystem(gguf, threads=1, binary=binary)
    try:
        prompts, outs = [[1, 504, 3112], [1, 2, 3, 4, 5, 6], [9] * 20, [1, 42]], [4, 1, 6, 3]
        timings = peer.serve(prompts, outs, concurrency=2)
        assert [t.output_tokens for t in timings] == outs and [t.prompt_tokens for t in timings] == [3, 6, 20, 2]
        assert all(0 < t.ttft_s <= t.finish_s for t in timings)
        info = peer.info()
        assert info["slots"] == 2 and "-np 2" in info["last_server_command"] and info["version"].startswith("version")
    finally:
        peer.close()
    assert peer._server is None


def test_a_server_that_crashes_at_start_says_which_signal_and_how_to_rebuild(tmp_path):
    """A llama-server built with kernels this VM refuses dies at its first product (SIGILL in session 19): the
    error names the signal and the rebuild, instead of 'exited'."""
    crash = tmp_path / "llama-server"
    crash.write_text("#!/bin/sh\nkill -ILL $$\n")
    crash.chmod(0o755)
    with pytest.raises(ConfigError, match=r"died with SIGILL .*build_llama_server\.sh"):
        ls.LlamaServer([str(crash)], port=9, startup_timeout_s=30)
    assert ls.exit_reason(2) == "exited with code 2"
