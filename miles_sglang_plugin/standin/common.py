"""What the stand-in's handler modules share: the request errors the middleware turns into JSON answers (in
the shapes SGLang 0.5.23's server gives them), and reading a JSON object body."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

#: SGLang's answer to a request whose body its FastAPI handler could not take (missing, not JSON, not its class):
#: 400 ``{"object": "error", "message": ..., "type": "Bad Request", "param": null, "code": 400}``.
MISSING_BODY = (
    "1 validation error:\n  {'type': 'missing', 'loc': ('body',), 'msg': 'Field required', 'input': None}"
)


class RequestError(Exception):
    """Turned into a JSON error response by the error middleware."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Refusal(Exception):
    """An answer SGLang gives with its own JSON body on an error status (e.g. ``{"success": false, ...}``)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body


def error_response(status: int, message: str) -> web.Response:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 422: "UnprocessableEntity"}.get(
        status, "Error"
    )
    return web.json_response(
        {"object": "error", "error": {"message": message, "type": kind, "code": status}}, status=status
    )


class BodyError(RequestError):
    """A body that SGLang's FastAPI validation refuses (400, its ``Bad Request`` shape)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)

    def response(self) -> web.Response:
        body = {"object": "error", "message": self.message, "type": "Bad Request", "param": None, "code": 400}
        return web.json_response(body, status=400)


async def json_object(request: web.Request, *, required: bool = True) -> dict[str, Any]:
    """The body as a JSON object (``{}`` for an empty body unless ``required``); 400 otherwise."""
    raw = await request.text()
    if not raw.strip():
        if required:
            raise RequestError(400, "the request body must be a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


async def control_body(request: web.Request) -> dict[str, Any]:
    """The body of a control route, as SGLang's FastAPI handlers take it: a JSON object is required (also on
    GET); none, or not a JSON object, is a 400 validation error."""
    raw = await request.text()
    if not raw.strip():
        raise BodyError(MISSING_BODY)
    try:
        body = json.loads(raw)
    except ValueError:
        raise BodyError(
            "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', 0), 'msg': 'JSON decode error'}"
        ) from None
    if not isinstance(body, dict):
        raise BodyError(
            f"1 validation error:\n  {{'type': 'model_type', 'loc': ('body',), 'input': {body!r}}}"
        )
    return body
