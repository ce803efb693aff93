"""OpenAI-shaped HTTP errors: {"error": {"message", "type", "param", "code"}}, never a stack trace."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "invalid_request_error",
          404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), exc.status, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        content_type = request.headers.get("content-type")
        if tuple(first.get("loc", ()))[:1] == ("body",) and not _is_json(content_type):
            return error_response(APIError(415, f"the request body must be JSON, sent with Content-Type: "
                                           f"application/json (not {content_type[:100]!r})", None,
                                           "unsupported_media_type"))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(APIError(400, "the request body is not valid JSON", None, "invalid_json"))
        param = ".".join(loc) or None
        if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
            return error_response(APIError(400, "the request body must be a JSON object", None, "invalid_value"))
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return error_response(APIError(400, msg, param, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), code=getattr(exc, "code", None),
                                       headers=exc.headers))  # 405's Allow

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, "internal server error", code="internal_error"))


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this type as JSON (it does when none is given)."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
