"""What the stand-in's handler modules share: the request error the middleware turns into a JSON answer, and
reading a JSON object body."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class RequestError(Exception):
    """Turned into a JSON error response by the error middleware."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> web.Response:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 422: "UnprocessableEntity"}.get(
        status, "Error"
    )
    return web.json_response(
        {"object": "error", "error": {"message": message, "type": kind, "code": status}}, status=status
    )


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
