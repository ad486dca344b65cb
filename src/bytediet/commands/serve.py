"""``bytediet serve``: the OpenAI-compatible HTTP server (uvicorn), on the loopback interface by default.

The port is bound before the model loads, so a clash fails at once and the start line
("serving ... on http://HOST:PORT") is printed only once the socket is really ours.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from ..config import parse_bytes
from ..errors import ConfigError
from ._engine_args import add_model_args, build_llm

API_KEY_ENV = "BYTEDIET_API_KEY"


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a model over HTTP with OpenAI's API: /v1/models, /v1/completions and "
        '/v1/chat/completions (streaming with "stream": true), /tokenize, /detokenize, /tokenizer_info, '
        "/health, /version and Prometheus /metrics. SIGTERM or Ctrl-C drains running requests, then exits.",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: loopback only; 0.0.0.0 exposes the server to the network)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients send (default: the --model value); responses carry the first",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level of the server and uvicorn (info prints one access line per request)",
    )
    g = p.add_argument_group("access and limits")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1 routes and the tokenizer routes "
        f"(repeatable; {API_KEY_ENV} adds one more); /health, /metrics, /version stay open",
    )
    g.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="origins allowed to call the API from a browser (CORS), e.g. http://localhost:3000 or '*'; "
        "default: none (no CORS headers)",
    )
    g.add_argument(
        "--max-body-bytes",
        default="16MiB",
        help="largest request body (e.g. 16MiB); larger ones get 413 before they are read",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=128,
        help="most prompts in one /v1/completions batch (n is capped at 128, as OpenAI does)",
    )
    g.add_argument(
        "--max-waiting-sequences",
        type=int,
        default=1024,
        help="most sequences waiting for the engine; beyond it requests get 503 with Retry-After",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length served (prompt + output); checked at start against the KV cache "
        "(default: the model's context, capped by what --kv-cache-memory holds)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may take to finish after SIGTERM/SIGINT before they are aborted",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the engine core (model, scheduler, sampling, detokenization) in a process of its own, "
        "so HTTP, JSON, SSE and tokenization never take its GIL (default: off, the engine runs on a "
        "thread of the server's process; see docs/engine_process.md)",
    )
    add_model_args(p)
    p.set_defaults(handler=run)


def server_config(args: argparse.Namespace):
    from ..server.config import ServerConfig

    keys = list(args.api_key)
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    return ServerConfig(
        api_keys=tuple(keys),
        allowed_origins=tuple(args.allowed_origins),
        max_body_bytes=parse_bytes(args.max_body_bytes),
        max_prompts_per_request=args.max_prompts_per_request,
        max_waiting_sequences=args.max_waiting_sequences,
        max_model_len=args.max_model_len,
        shutdown_timeout=args.shutdown_timeout,
    )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a ``ConfigError`` saying the port is taken (before any model is loaded)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}; is another server using that port? "
            "pick another with --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def build_engine(args: argparse.Namespace):
    """The model and engine of ``args`` (in the engine process with --engine-process), warmed up."""
    llm = build_llm(args)
    llm.warm_up()
    return llm


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server.app import build_app
    from ..server.shutdown import GracefulServer
    from ._memory import announce, plan_serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    config = server_config(args)
    if args.tensor_parallel_size == 1 and _on_cpu(args):  # refuse before loading what the machine cannot hold
        announce(
            plan_serve(args.model, args.weights, args.kv_cache_memory, args.max_num_batched_tokens, args.max_num_seqs)
        )
    sock = bind(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    engine, owner = start_engine(args)
    names = args.served_model_name or [args.model]
    try:
        app = build_app(engine, names, own_engine=True, config=config)
        state = app.state.server
        port = sock.getsockname()[1]
        sock.listen(2048)
        info = engine.info
        capped = (
            ""
            if state.max_model_len == info.max_model_len
            else f" (the model's {info.max_model_len} capped by the KV cache; raise --kv-cache-memory for more)"
        )
        where = "in its own process" if args.engine_process else "on a thread"
        print(
            f"bytediet: serving {info.source_path} as {', '.join(names)} on http://{args.host}:{port} "
            f"(context {state.max_model_len} tokens{capped}, {info.num_blocks} KV blocks "
            f"of {info.block_size} tokens, KV codec {info.kv_codec}, engine {where}"
            f"{', API key required' if config.api_keys else ''})",
            file=sys.stderr,
            flush=True,
        )
        uv = uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5, lifespan="on")
        GracefulServer(uv, state.drain, config.shutdown_timeout).run(sockets=[sock])
    finally:  # the app's lifespan already did this unless uvicorn failed to start
        engine.shutdown()
        if owner is not None:
            owner.shutdown()
        sock.close()
    return 0


def _on_cpu(args: argparse.Namespace) -> bool:
    """Whether the engine runs on the CPU (the memory plan is of this machine's memory, not a GPU's)."""
    device = getattr(args, "device", "cpu")
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def start_engine(args: argparse.Namespace):
    """(the server's engine, the LLM to shut down after it or None): an ``EngineProcess`` with --engine-process,
    else an ``AsyncEngine`` on a thread of this process."""
    if args.engine_process:
        from ..engine.engine_process import EngineProcess

        return EngineProcess(build_engine, args), None
    from ..engine.async_engine import AsyncEngine

    llm = build_engine(args)
    return AsyncEngine(llm.engine), llm
