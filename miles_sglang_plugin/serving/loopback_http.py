"""The deployment's own small HTTP servers (the engine listing, ``/metrics``): GET only, on a thread of their
own, an API key asked for where the deployment has one (compared in constant time), nothing logged."""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from miles_sglang_plugin.addresses import host_port

__all__ = ["LoopbackServer", "Reply", "json_reply"]

#: An answer: status, body, content type.
Reply = tuple[HTTPStatus, bytes, str]


def json_reply(status: HTTPStatus, body: Mapping[str, Any]) -> Reply:
    return status, json.dumps(body).encode(), "application/json"


class LoopbackServer:
    """Serves ``answer(path, accept)`` (the path without its query and trailing slash, the Accept header) on ``host:port``
    (port 0: one the system picks); with ``api_key``, a request without ``Authorization: Bearer <key>`` gets
    ``unauthorized`` instead."""

    def __init__(
        self,
        answer: Callable[[str, str], Reply],
        *,
        unauthorized: Reply,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        expected = f"Bearer {api_key}".encode() if api_key else None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                given = self.headers.get("Authorization", "").encode()
                if expected is not None and not hmac.compare_digest(given, expected):
                    status, body, content_type = unauthorized
                else:
                    path = self.path.split("?", 1)[0].rstrip("/")
                    status, body, content_type = answer(path, self.headers.get("Accept", ""))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)
        self._thread.start()
        self.host, self.port = host, int(self._server.server_address[1])

    @property
    def address(self) -> str:
        """``host:port``, as a scrape target."""
        return host_port(self.host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
