"""The API's refusals: `ApiError` (an OpenAI-style error with its HTTP status) and the exception handlers
that turn it, a request body that fails validation and Starlette's own HTTP errors into one body shape,
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrt.serving import guards
from specrt.serving.protocol import describe_errors


class ApiError(Exception):
    """A refusal with its status, the request field it names (`param`) and an OpenAI error code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(status: int, message: str, param=None, code=None, kind="invalid_request_error",
                   headers=None) -> JSONResponse:
    return JSONResponse(guards.error_payload(message, kind, param, code), status_code=status, headers=headers)


async def invalid_body(request, exc: RequestValidationError) -> JSONResponse:
    """A field of the wrong type or out of range: 400 naming the field."""
    message, param = describe_errors(exc.errors())
    return error_response(400, message, param)


async def api_error(request, exc: ApiError) -> JSONResponse:
    """503 (every slot and the queue full) tells the client when to come back."""
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.kind, headers)


async def http_error(request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)


def install(app: FastAPI) -> None:
    """Every refusal of `app` in the one error shape."""
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
