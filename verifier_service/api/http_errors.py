"""OpenAI error objects with the HTTP status each failure deserves.

`{"error": {"message", "type", "param", "code"}}`, as OpenAI (and vLLM) answer.
A client mistake is a 4xx naming what to change, never a 500: bad input 400 (the
messages gRPC's INVALID_ARGUMENT gives), a missing or wrong token 401, an unknown
model 404, an oversized body 413, a full queue 429, not ready or draining 503.
"""

from __future__ import annotations

from http import HTTPStatus

import grpc
from fastapi.responses import JSONResponse
from pydantic import ValidationError

ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
    413: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
}
# gRPC status of a request_parsing.RequestError -> HTTP status.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
}


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, HTTPStatus(self.status).phrase),
                          "param": self.param, "code": self.code or self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# Anthropic's error types by HTTP status (its Messages API's routes answer in its shape).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
}


class AnthropicError(HttpError):
    """The same failure as Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""

    @classmethod
    def of(cls, error: HttpError) -> AnthropicError:
        return cls(error.status, error.message, error.param, error.code)

    def body(self) -> dict[str, object]:
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}


def from_validation(exc: ValidationError) -> HttpError:
    """400 naming the first offending field (its path in the body) and what is wrong with it."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    # A union reports each alternative under its type name: keep the path to the field itself.
    path = [str(p) for p in first["loc"] if not _is_type_tag(p)]
    field = ".".join(path) or "body"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return HttpError(400, f"{field}: {first['msg']}{more}", param=field)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})
