"""One error type for every API the proxy serves; each API writes it in its own wire shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# Anthropic names its error types by status; anything unlisted is its generic api_error
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        """OpenAI's shape."""
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)

    def anthropic_response(self) -> JSONResponse:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": self.message}},
                            status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
