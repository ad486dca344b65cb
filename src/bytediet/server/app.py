"""The OpenAI-compatible FastAPI app: ``build_app(async_engine, "model-name", config=ServerConfig(...))``.

Endpoints: ``GET /v1/models`` and ``/v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both stream Server-Sent Events with ``"stream": true``), ``POST /tokenize`` and ``/detokenize``,
``GET /tokenizer_info``, ``GET /health`` (503 once the engine thread has stopped), ``GET /metrics`` (Prometheus text),
``GET /version``, ``GET /`` (a chat page with live metrics, ``web/index.html``), and ``/docs`` (Swagger UI, its assets
served from this process: it renders offline).
The middlewares (``middleware.py``) add API keys, CORS, the body limit, draining and request ids.
With ``own_engine=True`` the app shuts the engine down when the ASGI server stops it.
"""

from __future__ import annotations

import logging
import platform
from contextlib import asynccontextmanager
from importlib import resources
from typing import Optional, Sequence, Union

import torch
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi_offline import FastAPIOffline

from .. import __version__
from ..engine.async_engine import AsyncEngine
from .chat import create_chat_completion
from .completions import create_completion
from .config import ServerConfig, served_model_len
from .errors import APIError, error_response, install_error_handlers
from .metrics import ServerMetrics
from .middleware import APIKeys, BodyLimit, Draining, RequestContext
from .protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard, ModelList
from .serving import ServerState
from .tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    detokenize,
    tokenize,
    tokenizer_info,
)

log = logging.getLogger("bytediet.server")
PAGE = (resources.files(__package__) / "web" / "index.html").read_text(encoding="utf-8")  # chat box + live metrics
ERRORS = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}


def build_app(
    engine: AsyncEngine,
    served_model_names: Union[str, Sequence[str]],
    metrics: Optional[ServerMetrics] = None,
    own_engine: bool = False,
    config: Optional[ServerConfig] = None,
) -> FastAPI:
    """An app serving ``engine`` under ``served_model_names`` (the first is the name responses carry).

    Raises ``ConfigError`` when ``config.max_model_len`` cannot be served (see ``served_model_len``).
    """
    names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("served_model_names: give at least one non-empty model name")
    config = config or ServerConfig()
    state = ServerState(
        engine,
        names,
        metrics or ServerMetrics(engine, names[0]),
        served_model_len(engine.info, config.max_model_len),
        config,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if own_engine:
            engine.shutdown()
            total = engine.info.num_blocks
            log.info("engine stopped; KV blocks in use: %d of %d", total - engine.counters().num_free_blocks, total)

    app = FastAPIOffline(
        title="bytediet",
        version=__version__,
        lifespan=lifespan,
        static_url="/docs/static",
        description="OpenAI-compatible completions and chat completions, served by bytediet.",
    )
    app.state.server = state
    install_error_handlers(app)
    _add_middleware(app, state)

    @app.get("/health")
    async def health() -> Response:
        if not engine_alive(engine):
            return error_response(503, "the engine has stopped; restart the server", type="server_error")
        failure = engine.failure
        if failure is not None:  # a tensor-parallel worker died: every step would fail
            return error_response(503, failure, type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__, "torch": torch.__version__, "python": platform.python_version()}

    def card(name: str) -> ModelCard:
        return ModelCard(
            id=name, created=state.created, root=engine.info.source_path, max_model_len=state.max_model_len
        )

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def model(model_id: str) -> ModelCard:
        if model_id not in names:
            raise APIError(
                404,
                f"The model `{model_id}` does not exist; this server serves {', '.join(names)}.",
                "model",
                code="model_not_found",
            )
        return card(model_id)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize_endpoint(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(body, state)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize_endpoint(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(body, state)

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=ERRORS)
    async def tokenizer_info_endpoint() -> TokenizerInfo:
        return await tokenizer_info(state)

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    return app


def _add_middleware(app: FastAPI, state: ServerState) -> None:
    """Outermost last: request context → draining → CORS → body limit → API keys → the routes."""
    config = state.config
    if config.api_keys:
        app.add_middleware(APIKeys, keys=config.api_keys)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(Draining, is_draining=lambda: state.drain.draining, retry_after=config.retry_after)
    app.add_middleware(RequestContext)


def engine_alive(engine: AsyncEngine) -> bool:
    """Whether the engine's thread (or process, :class:`EngineProcess`) still runs (it stops only on shutdown)."""
    return engine.is_alive
