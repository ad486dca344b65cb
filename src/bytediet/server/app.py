"""The OpenAI-compatible FastAPI app: ``build_app(async_engine, "model-name")``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream
Server-Sent Events with ``"stream": true``), ``GET /health`` (503 once the engine thread has
stopped) and ``GET /metrics`` (Prometheus text). With ``own_engine=True`` the app shuts the engine
down when the ASGI server stops it (uvicorn does so on SIGINT/SIGTERM, then re-raises the signal).
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..engine.async_engine import AsyncEngine
from .chat import create_chat_completion
from .completions import create_completion
from .errors import error_response, install_error_handlers
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard, ModelList
from .serving import ServerState

ERRORS = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}


def build_app(engine: AsyncEngine, served_model_names: Union[str, Sequence[str]],
              metrics: Optional[ServerMetrics] = None, own_engine: bool = False) -> FastAPI:
    """An app serving ``engine`` under ``served_model_names`` (the first is the name responses carry)."""
    names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("served_model_names: give at least one non-empty model name")
    state = ServerState(engine, names, metrics or ServerMetrics(engine, names[0]))
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if own_engine:
            engine.shutdown()

    app = FastAPI(title="bytediet", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions, served by bytediet.")
    app.state.server = state
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not engine_alive(engine):
            return error_response(503, "the engine thread has stopped; restart the server", type="server_error")
        failure = engine.engine.failure
        if failure is not None:  # a tensor-parallel worker died: every step would fail
            return error_response(503, failure, type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        source = getattr(engine.engine.model, "source_path", None)
        return ModelList(data=[ModelCard(id=name, created=state.created, root=source,
                                         max_model_len=state.max_model_len) for name in names])

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    return app


def engine_alive(engine: AsyncEngine) -> bool:
    """Whether the engine's background thread still runs (it stops only on shutdown)."""
    return engine.is_alive
