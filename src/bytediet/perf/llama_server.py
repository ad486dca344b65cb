"""llama.cpp's own HTTP server, ``llama-server``, as a serving peer: parallel slots and continuous batching.

``llama-cpp-python`` runs one sequence per context, so as a concurrency peer it serves requests one after
the other. ``llama-server`` is how llama.cpp serves many clients: ``-np N`` slots, each with its own
``n_ctx`` of KV cache, decoded together in one batch per step (continuous batching: a finished slot takes the
next request between steps). It is built by ``bench/build_llama_server.sh`` from the llama.cpp sources that
the pinned ``llama-cpp-python`` sdist vendors, so both peers run the same llama.cpp.

The peer streams ``POST /completion`` with the prompt as token ids (``return_tokens`` gives the ids of
every chunk, so partial UTF-8 characters still count) and ``n_predict`` + ``ignore_eos`` force exactly
``max_tokens`` tokens; times are taken at the client as each chunk arrives, like the other peers.
Only the standard library is used (``http.client`` in threads): no HTTP package at run time.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from ..errors import ConfigError
from .bench import RequestTiming

BUILD_SCRIPT = "bench/build_llama_server.sh"
ENV_BINARY = "BYTEDIET_LLAMA_SERVER"  # an explicit llama-server binary
ENV_DIR = "BYTEDIET_LLAMA_SERVER_DIR"  # where the build script puts <version>/build/bin/llama-server


def llama_cpp_python_version() -> Optional[str]:
    """The installed ``llama-cpp-python`` (the pin whose sdist the build uses), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "bytediet" / "llama-server")


def find_binary() -> tuple[Optional[Path], str]:
    """``(path, "")`` of the llama-server to run, or ``(None, why not and how to build it)``.

    Looked up in order: ``$BYTEDIET_LLAMA_SERVER``; the build script's output for the installed
    llama-cpp-python version; any version the build script left in its cache directory.
    """
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""
        return None, f"${ENV_BINARY}={explicit} is not an executable file"
    version = llama_cpp_python_version()
    candidates = [cache_dir() / version / "build" / "bin" / "llama-server"] if version else []
    candidates += sorted(cache_dir().glob("*/build/bin/llama-server"), reverse=True)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""
    return None, (
        f"llama-server is not built (looked in {cache_dir()}); build it with `{BUILD_SCRIPT}` "
        f"(cmake, ~15 min on 2 cores) or point ${ENV_BINARY} at a llama-server binary"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    binary: Path, gguf: Path, *, port: int, threads: int, slots: int, ctx_per_slot: int, prompt_cache: bool = False
) -> list[str]:
    """The llama-server command line: ``slots`` parallel slots of ``ctx_per_slot`` tokens each.

    ``-c`` is the total context, split evenly over the slots (the KV cache is not unified when ``-np``
    is given). ``prompt_cache=False`` turns off the RAM prompt cache (``-cram 0``), as the benchmark turns
    off bytediet's prefix caching; requests then say ``cache_prompt: false`` too.
    """
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(ctx_per_slot * slots),
        "--cont-batching",
        "--metrics",
        "--slots",
        "--no-webui",
        "--threads-http",
        str(max(4, slots + 2)),
    ]
    return cmd + ([] if prompt_cache else ["-cram", "0"])


def completion_body(
    prompt: Union[Sequence[int], str],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    cache_prompt: bool = False,
    seed: int = 0,
) -> dict:
    """A streaming ``/completion`` request for exactly ``max_tokens`` tokens (end-of-sequence ignored);
    temperature 0 is greedy (llama.cpp's temperature sampler keeps only the top logit)."""
    body = {
        "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
        "n_predict": int(max_tokens),
        "ignore_eos": True,
        "temperature": temperature,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": cache_prompt,
        "seed": seed,
    }
    if temperature <= 0:
        body["top_k"] = 1
    return body


@dataclass(frozen=True)
class StreamEvent:
    """One server-sent event of a ``/completion`` stream: ``tokens`` new token ids, ``stop`` on the last."""

    tokens: int = 0
    text: str = ""
    stop: bool = False
    error: Optional[str] = None


def parse_stream_line(line: Union[str, bytes]) -> Optional[StreamEvent]:
    """The event of one line of the stream (``data: {...}``), or None for blank lines and other fields."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return StreamEvent(stop=True)
    event = json.loads(payload)
    if "error" in event:
        err = event["error"]
        return StreamEvent(stop=True, error=err.get("message", str(err)) if isinstance(err, dict) else str(err))
    tokens = event.get("tokens")
    count = len(tokens) if isinstance(tokens, list) else (1 if event.get("content") else 0)
    return StreamEvent(tokens=count, text=event.get("content", ""), stop=bool(event.get("stop")))


def stream_completion(port: int, body: dict, t0: float, timeout_s: float = 600.0) -> RequestTiming:
    """POST ``body`` to ``/completion`` and time its stream; seconds since ``t0`` (the arrival of every request)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ConfigError(f"llama-server: HTTP {resp.status}: {resp.read()[:300]!r}")
        first, count = None, 0
        for raw in resp:
            event = parse_stream_line(raw)
            if event is None:
                continue
            if event.error:
                raise ConfigError(f"llama-server: {event.error}")
            if event.tokens:
                count += event.tokens
                first = first or time.perf_counter()
            if event.stop:
                break
        finish = time.perf_counter()
    finally:
        conn.close()
    if count != body["n_predict"]:
        raise ConfigError(f"llama-server returned {count} tokens, asked for exactly {body['n_predict']}")
    prompt = body["prompt"]
    return RequestTiming(len(prompt) if isinstance(prompt, list) else 0, count, first - t0, finish - t0)


def exit_reason(returncode: int) -> str:
    """How a llama-server that stopped on its own ended, with what to do about a crash."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = ""
    if name in ("SIGILL", "SIGSEGV", "SIGBUS"):
        hint = (
            " (a kernel this CPU or VM refuses: rebuild it with bench/build_llama_server.sh, which turns AMX off "
            "where it is advertised)"
        )
    return f"died with {name}{hint}"


class LlamaServer:
    """One llama-server process on a free loopback port; its output goes to a log file (the tail is in errors)."""

    def __init__(self, command: list[str], port: int, startup_timeout_s: float = 300.0) -> None:
        self.command, self.port = command, port
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + startup_timeout_s
        while self.get("/health")[0] != 200:  # 503 while the model loads
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                why = exit_reason(code) if code is not None else "did not answer /health in time"
                self.stop()
                raise ConfigError(f"llama-server {why}: {' '.join(command)}\n{self.log_tail()}")
            time.sleep(0.2)

    def get(self, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
        """``(status, body)`` of a GET, ``(0, reason)`` when nothing answers."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as exc:
            return 0, repr(exc)
        finally:
            conn.close()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def binary_version(binary: Path) -> str:
    """The ``version: N (commit)`` line of ``llama-server --version``."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"? ({exc})"
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "?"


class LlamaServerSystem:
    """llama.cpp's ``llama-server`` on the GGUF file: ``-np concurrency`` slots with continuous batching.

    The server is started at the first :meth:`serve` and restarted when the concurrency changes or a
    request needs more context than a slot holds (slot contexts are rounded up to 256 tokens).
    """

    name = "llama-server"

    def __init__(self, gguf_path: Path, threads: int, binary: Optional[Path] = None) -> None:
        if binary is None:
            binary, reason = find_binary()
            if binary is None:
                raise ConfigError(reason)
        self.path, self.threads, self.binary = Path(gguf_path), threads, Path(binary)
        self.version = binary_version(self.binary)
        self._server: Optional[LlamaServer] = None
        self._key: tuple[int, int] = (0, 0)  # (slots, context per slot) of the running server

    def info(self) -> dict:
        from .peers import gguf_tensor_bytes

        slots, ctx = self._key
        return {
            "system": "llama-server",
            "binary": str(self.binary),
            "version": self.version,
            "package": f"llama.cpp llama-server ({self.version}), built from llama-cpp-python "
            f"{self.source_version()} sources",
            "source": str(self.path),
            "weights": "GGUF blocks as stored",
            "weight_bytes": gguf_tensor_bytes(self.path),
            "threads": self.threads,
            "concurrency_mode": "llama-server: -np = concurrency slots, continuous batching",
            "last_server_command": " ".join(self._server.command) if self._server else None,
            "slots": slots or None,
            "ctx_per_slot": ctx or None,
        }

    def source_version(self) -> str:
        """The llama-cpp-python sdist the binary was built from (the build script's <version> directory)."""
        built = self.binary.parents[2] if len(self.binary.parents) > 2 else None
        if built is not None and built.parent == cache_dir():
            return built.name
        return llama_cpp_python_version() or "?"

    def server(self, concurrency: int, longest: int) -> LlamaServer:
        ctx = 256 * -(-(longest + 16) // 256)  # sized per call: 64 slots of the context part's 8192 would not fit
        if self._server is None or self._key[0] != concurrency or self._key[1] < ctx:
            self.close()
            port = free_port()
            cmd = server_command(
                self.binary, self.path, port=port, threads=self.threads, slots=concurrency, ctx_per_slot=ctx
            )
            self._server, self._key = LlamaServer(cmd, port), (concurrency, ctx)
        return self._server

    def serve(self, prompts, max_tokens, concurrency) -> list[RequestTiming]:
        server = self.server(concurrency, max(len(p) + n for p, n in zip(prompts, max_tokens)))
        bodies = [completion_body(p, n) for p, n in zip(prompts, max_tokens)]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:  # at most `concurrency` requests in flight
            t0 = time.perf_counter()
            futures = [pool.submit(stream_completion, server.port, body, t0) for body in bodies]
            try:
                return [f.result() for f in futures]
            except ConfigError as exc:
                for f in futures:
                    f.cancel()
                raise ConfigError(f"{exc}\n{server.log_tail(5)}") from None

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server, self._key = None, (0, 0)
