"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Bad input never reaches the engine: pydantic errors (malformed JSON, a missing or mistyped field) and
the engine's own ``ConfigError`` (a value out of range, a prompt too long) both become HTTP 400 naming
the field in ``param``; the server keeps serving other requests.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import BytedietError
from .protocol import ErrorInfo, ErrorResponse

_FIELD = re.compile(r"^([a-z_]+)\b")


class APIError(Exception):
    """An error the client must see as ``status`` with OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        type: str = "invalid_request_error",
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    @classmethod
    def bad_request(
        cls, exc: BytedietError, aliases: Optional[dict[str, str]] = None, fields: Sequence[str] = ()
    ) -> "APIError":
        """HTTP 400 from an engine error whose message starts with the field name ("temperature must ...").

        ``aliases`` renames engine fields to the request's (``prompt`` → ``messages`` for chat), in
        ``param`` and in the message;
        a leading word that is not one of ``fields`` (after renaming) leaves ``param`` null.
        """
        message = str(exc)
        match = _FIELD.match(message)
        param = match.group(1) if match else None
        if param in (aliases or {}):  # say it in the request's words
            message = aliases[param] + message[len(param) :]
            param = aliases[param]
        return cls(400, message, param if param in fields else None)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.type, self.code, self.headers)


def error_response(
    status: int,
    message: str,
    param: Optional[str] = None,
    type: str = "invalid_request_error",
    code: Optional[str] = None,
    headers: Optional[dict[str, str]] = None,
) -> JSONResponse:
    """OpenAI's error object; text the client sent (a lone surrogate in a model name) is escaped, never a 500."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """pydantic's errors → one 400; ``param`` is the top-level field of the first error."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return error_response(
            400,
            "the body must be a JSON object sent with Content-Type: application/json "
            f"({first.get('msg', 'invalid body')})",
        )
    return error_response(400, _describe(str(loc[0]), errors), str(loc[0]))


def _describe(param: str, errors: list[dict]) -> str:
    """One line for the errors of field ``param``; a union field lists the accepted shapes."""
    mine = [e for e in errors if len(e.get("loc", ())) > 1 and str(e["loc"][1]) == param]
    ours = [e for e in mine if e.get("type") == "value_error"]  # our own validators say precisely what is wrong
    if ours:
        path = ".".join(str(p) for p in ours[0]["loc"][1:] if not _is_union_tag(p))
        return f"{path}: {str(ours[0].get('msg', '')).removeprefix('Value error, ')}"
    shapes = list(dict.fromkeys(str(e["loc"][2]) for e in mine if len(e["loc"]) > 2 and _is_union_tag(e["loc"][2])))
    if len(shapes) > 1:
        return f"{param}: not a valid value; expected one of: {', '.join(shapes)}"
    first = mine[0] if mine else errors[0]
    path = ".".join(str(p) for p in first["loc"][1:])
    return f"{path}: {first.get('msg', 'invalid value')}"


def _is_union_tag(part) -> bool:
    """pydantic names union members in ``loc`` by their type (``str``, ``list[int]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server as OpenAI's error object (the server itself keeps running)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type=kind)

    # Unexpected exceptions become a 500 in middleware.RequestContext, which keeps the connection alive.
