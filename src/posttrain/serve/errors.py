"""The serve room's errors: `ServeError` for a user's setup mistake, `APIError` for a bad HTTP request."""

from __future__ import annotations

from typing import Any

from posttrain.types import PosttrainError


class ServeError(PosttrainError):
    """The server or chat cannot start as asked (missing checkpoint, unusable engine, port in use ...)."""


class APIError(Exception):
    """A request the server refuses: rendered as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
