"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

logger = logging.getLogger("moeserve.server")


class APIError(Exception):
    """An error the client should see as it is."""

    def __init__(
        self, status: int, message: str, type: str | None = None, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status)


class EngineDeadError(RuntimeError):
    """The engine process died; nothing in flight will finish."""


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 for invalid parameters or input."""
    return APIError(400, message, param=param)


def from_value_error(e: ValueError) -> APIError:
    """A 400 from the engine's validation, naming the parameter when its message starts with one."""
    message = str(e)
    first = message.split(" ", 1)[0]
    param = first if first.replace("_", "").isalpha() and first.islower() and " must" in message else None
    return bad_request(message, param)


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first field pydantic rejected."""
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    return bad_request(message, param)


def install_handlers(app: FastAPI) -> None:
    """Make every error the app raises OpenAI-shaped."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return from_validation_error(e).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return APIError(500, str(e), code="engine_dead").response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(e).__name__}: {e}").response()
