"""Pure ASGI middlewares around the app, outermost first: request context, draining, body limit, API keys.

They are plain ASGI (not Starlette's ``BaseHTTPMiddleware``) so a streamed response passes through
untouched and a client's ``http.disconnect`` still reaches the endpoint.

* :class:`RequestContext`: an ``X-Request-Id`` (the client's, or a fresh one) on every response and in
  the access log line; an unexpected exception becomes OpenAI's 500 error object *here*, inside
  Starlette's ``ServerErrorMiddleware``, which would re-raise it and make uvicorn drop the keep-alive
  connection without ``Connection: close`` (the client's next request then met a reset).
* :class:`Draining`: once shutdown began, every new request gets 503 with ``Retry-After``.
* :class:`BodyLimit`: a body over ``max_body_bytes`` is refused with 413 before anything parses it
  (by ``Content-Length`` at once, or while a chunked body streams in).
* :class:`APIKeys`: ``Authorization: Bearer KEY`` on every ``/v1`` route and on ``/tokenize``, ``/detokenize``,
  ``/tokenizer_info``.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
import uuid
from typing import Callable, Iterable

from .errors import error_response

access_log = logging.getLogger("bytediet.server.access")
log = logging.getLogger("bytediet.server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")  # echoed only when it is safe in a header and a log


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class RequestContext:
    """Request id, access log, and a last-resort 500 that keeps the connection usable."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _header(scope, b"x-request-id")
        rid = given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        status, t0 = [0], time.perf_counter()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status[0]:  # the response already started: only dropping the connection can end it
                raise
            log.exception("internal error while serving request %s", rid)
            await error_response(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")(
                scope, receive, send_with_id
            )
        finally:
            client = scope.get("client") or ("-", 0)
            access_log.info(
                '%s:%s "%s %s" %d %.3fs request_id=%s',
                client[0],
                client[1],
                scope["method"],
                scope["path"],
                status[0],
                time.perf_counter() - t0,
                rid,
            )


class Draining:
    """503 with ``Retry-After`` for every new request once ``is_draining()`` (graceful shutdown)."""

    def __init__(self, app, is_draining: Callable[[], bool], retry_after: int = 5) -> None:
        self.app, self.is_draining, self.retry_after = app, is_draining, retry_after

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.is_draining():
            response = error_response(
                503,
                "the server is shutting down; retry on another replica or later",
                type="server_error",
                code="shutting_down",
                headers={"Retry-After": str(self.retry_after), "Connection": "close"},
            )
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a request body over ``max_bytes``, before the endpoint parses a byte of it."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _refuse(self, size: str):
        return error_response(
            413,
            f"the request body ({size}) exceeds the server's limit of {self.max_bytes} "
            "bytes; send a smaller request or start the server with a larger --max-body-bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(f"{int(length)} bytes")(scope, receive, send)
        seen, over = [0], [False]

        async def counted_receive():
            if over[0]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_bytes:  # a chunked body grew past the limit: stop reading it
                    over[0] = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            if not over[0]:  # once over, the app's own answer (a parse error) is replaced by the 413
                await send(message)

        await self.app(scope, counted_receive, guarded_send)
        if over[0]:
            await self._refuse(f"more than {self.max_bytes} bytes")(scope, receive, send)


class APIKeys:
    """OpenAI's 401 unless ``Authorization: Bearer <one of keys>`` (constant-time compare), on guarded paths."""

    GUARDED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")

    def __init__(self, app, keys: Iterable[str]) -> None:
        self.app, self.keys = app, [k.encode() for k in keys]

    def _allowed(self, scope) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode("latin-1")
        return any(secrets.compare_digest(given, key) for key in self.keys)

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"].startswith(self.GUARDED)
            and not self._allowed(scope)
        ):
            response = error_response(
                401,
                "Incorrect or missing API key: send it as 'Authorization: Bearer KEY' "
                "(a key given to the server with --api-key or BYTEDIET_API_KEY)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        await self.app(scope, receive, send)
