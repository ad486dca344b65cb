"""``bytediet serve``: the OpenAI-compatible HTTP server (uvicorn), on the loopback interface by default."""
from __future__ import annotations

import argparse
import sys

from ._engine_args import add_model_args, build_llm


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a model over HTTP with OpenAI's API: /v1/models, /v1/completions and "
                    "/v1/chat/completions (streaming with \"stream\": true), /health and Prometheus /metrics.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: loopback only; 0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients send (default: the --model value); responses carry the first")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.async_engine import AsyncEngine
    from ..server.app import build_app
    from .generate import engine_description

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    llm = build_llm(args)
    engine = AsyncEngine(llm.engine)
    names = args.served_model_name or [args.model]
    try:
        app = build_app(engine, names, own_engine=True)
        print(f"bytediet: serving {llm.model.source_path} as {', '.join(names)} on http://{args.host}:{args.port} "
              f"(context {llm.engine.max_model_len} tokens, {llm.engine.block_manager.num_blocks} KV blocks "
              f"of {llm.engine.block_manager.block_size} tokens, KV codec "
              f"{engine_description(llm)['kv_cache_dtype']})", file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:  # the app's lifespan already did this unless uvicorn failed to start
        engine.shutdown()
    return 0
