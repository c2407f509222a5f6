"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure the ingress meets."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.responses import ErrorDetail, ErrorResponse
from engine.sampling_params import InvalidRequestError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable", 504: "timeout_error"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers  # e.g. Retry-After on 429/503, WWW-Authenticate on 401
        self.body = ErrorResponse(error=ErrorDetail(message=message, type=type or _TYPES.get(status, "error"),
                                                    param=param, code=code))

    @classmethod
    def invalid(cls, exc: InvalidRequestError, param: str | None = None) -> "OpenAIError":
        """A 400 with the check's own param and code; `param` renames the field where the endpoint calls it
        otherwise."""
        return cls(400, str(exc), param or exc.param, exc.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = param or (loc[0] if loc else None)
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "the request body is not valid", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return OpenAIError.invalid(exc).response()

    @app.exception_handler(RequestValidationError)
    async def schema_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return OpenAIError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return internal_error().response()


def internal_error() -> OpenAIError:
    """A 500 says what happened, never how: no exception text, remote traceback or path reaches the client."""
    return OpenAIError(500, "the server failed while handling this request; it is logged on the server side",
                       code="internal_error")
