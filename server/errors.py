"""The server's errors: every failure a client sees is OpenAI's JSON error object, never a traceback.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status it was raised with.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def validation_error(exc: ValidationError, prefix: str = "", rename: dict[str, str] | None = None) -> APIError:
    """A 400 naming the first bad field as ``param``; ``rename`` maps engine field names to the API's."""

    def where(loc: tuple) -> str:
        return prefix + ".".join(str((rename or {}).get(str(part), part)) for part in loc)

    errors = exc.errors()
    problems = "; ".join(f"{where(e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
    return APIError(400, f"invalid request: {problems}", param=where(errors[0]["loc"]) or None, code="invalid_value")
