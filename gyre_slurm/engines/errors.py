"""The one error type of the embedded engine: a refused request, answered as SGLang answers one."""

from __future__ import annotations

from typing import Any


class EngineHTTPError(Exception):
    """A request the engine refuses; `status` is the HTTP status, the message goes in {"error": {"message"}}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

    def body(self) -> dict[str, Any]:
        return error_body(str(self))


def error_body(message: str) -> dict[str, Any]:
    """SGLang's shape for a failed request (http_server._create_error_response)."""
    return {"error": {"message": message}}


def bad_request(message: str) -> EngineHTTPError:
    return EngineHTTPError(400, message)
