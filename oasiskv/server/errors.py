"""APIError: every error the server answers with, in OpenAI's shape.

Raised anywhere in the server (request checks, the engine bridge, auth) and turned into
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status by the app's handlers, or
into an SSE error event once a stream has started. Status decides who is at fault: 4xx are the
client's, 5xx the server's. Needs no web framework.
"""
from __future__ import annotations

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
    500: "server_error", 503: "service_unavailable",
}


class APIError(Exception):
    """An error answer: HTTP ``status``, a message for humans, the offending request field
    (``param``) and a machine-readable ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}  #: HTTP headers of the answer (Retry-After, Allow, ...)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status,
                          "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
