"""The API's errors: ApiError, raised by any route, answered with OpenAI's body
{"error": {message, type, param, code}} (server/app.py's handler; Anthropic's routes answer
their own shape from it)."""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import Struct


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo
