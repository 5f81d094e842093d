"""One error type for every API the proxy serves; each API writes it in its own wire shape. Also the check that
a request names a model the proxy serves (the same for every API)."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

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


# "policy" is the name /v1/models lists; "*" takes any other name. Unmodified harnesses send their own model
# names (Claude Code "claude-sonnet-4-5-…" and "claude-haiku-…", Codex "gpt-5-codex", …) and the proxy serves
# one policy whatever the name, so by default no name is refused. Narrow it (Proxy(served_models=…), the
# repeatable --served-model flag, which replaces this list) to have other names answered 404 model_not_found.
DEFAULT_SERVED_MODELS = ("policy", "*")
_GLOB = frozenset("*?[")


class ServedModels:
    """The model names a proxy answers to: fnmatch patterns, case-sensitive. The plain names (no *, ? or [)
    are what /v1/models lists."""

    def __init__(self, patterns: Iterable[str] | str | None = None) -> None:
        if isinstance(patterns, str):
            patterns = [patterns]
        self.patterns = tuple(dict.fromkeys(DEFAULT_SERVED_MODELS if patterns is None else patterns))
        if not self.patterns or not all(isinstance(p, str) and p for p in self.patterns):
            raise ValueError(f"served models must be non-empty names or fnmatch patterns, got {self.patterns!r}")
        self.names = [p for p in self.patterns if not _GLOB & set(p)]

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and any(fnmatchcase(model, p) for p in self.patterns)

    def check(self, model: str) -> None:
        """404 in each API's shape (OpenAI: model_not_found) for a model this proxy does not serve."""
        if model not in self:
            shown = model if len(model) <= 200 else model[:200] + "…"
            raise ApiError(404, f"The model '{shown}' does not exist: this proxy serves "
                                f"{', '.join(self.patterns)}", param="model", code="model_not_found")
