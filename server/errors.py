"""The server's errors: every failure a client sees is OpenAI's JSON error object, never a traceback.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status it was raised with. An error that
no handler answered is a 500 of the same shape, and it leaves the client's keep-alive connection open.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


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

    def why(error: dict) -> str:
        # pydantic's "Extra inputs are not permitted" does not say that the server knows no such field
        return "not a supported field" if error["type"] == "extra_forbidden" else error["msg"]

    errors = exc.errors()
    problems = "; ".join(f"{where(e['loc']) or 'body'}: {why(e)}" for e in errors[:5])
    return APIError(400, f"invalid request: {problems}", param=where(errors[0]["loc"]) or None, code="invalid_value")


class UnexpectedErrors:
    """ASGI middleware: an exception no handler answered is logged and answered as a 500 error object.

    Starlette's last-resort handler re-raises after answering, and uvicorn then closes the connection under
    the client, whose next request on it fails; here nothing is re-raised. An exception after the response
    has started cannot be answered any more: it propagates, and the dropped connection tells the client
    that the body is incomplete.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception:
            if started:
                raise
            logger.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            response = APIError(500, "internal server error; see the server log", "server_error").response()
            await response(scope, receive, send)
