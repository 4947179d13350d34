"""An HTTP server that answers like an engine that misbehaves (for the external-engine tests): it drips its
answers (a byte every 0.2 s, without end), reports garbage in ``/server_info``, or streams an endless
``/server_info``. It runs on a thread of the test process, on loopback, at a port found free; ``mode`` may
change while it runs (a healthy engine that starts dripping its ``/health``). It counts the drips it started and those still open:
a drip never ends by itself, so one that closed was closed by the client (it gave up on the answer)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

from aiohttp import web

#: What a healthy answer of /server_info holds (a tp_size 1 engine).
SERVER_INFO = {"tp_size": 1, "pp_size": 1, "model_path": "/judge", "weight_version": "default"}


class MisbehavingEngine:
    """``mode``: ``healthy`` (answers every route at once), ``drip`` (headers, then a byte every 0.2 s, never
    ending), ``drip_health`` (healthy but /health and /health_generate drip), ``garbage_info`` (/server_info
    says ``tp_size: "abc"``), ``endless_info`` (/server_info streams without end)."""

    def __init__(self, mode: str = "healthy") -> None:
        self.mode = mode
        #: Drips started, and those whose client has not closed the connection yet.
        self.drips_started = 0
        self.drips_open = 0
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="misbehaving-engine", daemon=True)

    def __enter__(self) -> MisbehavingEngine:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _drip(self, request: web.Request) -> web.StreamResponse:
        self.drips_started += 1
        self.drips_open += 1
        try:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            while True:  # until the client closes the connection (a write fails, or the handler is cancelled)
                await response.write(b" ")
                await asyncio.sleep(0.2)
        finally:
            self.drips_open -= 1

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"tp_size": 1, "padding": "')
        chunk = b"x" * 65536
        while True:
            await response.write(chunk)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["path"]
        health = path in ("/health", "/health_generate")
        if self.mode == "drip" or (self.mode == "drip_health" and health):
            return await self._drip(request)
        if path in ("/server_info", "/get_server_info"):
            if self.mode == "garbage_info":
                return web.json_response({"tp_size": "abc"})
            if self.mode == "endless_info":
                return await self._endless(request)
            return web.json_response(SERVER_INFO)
        if path == "/model_info":
            return web.json_response({"model_path": "/judge", "weight_version": "default"})
        if health:
            return web.Response(status=200)
        body: Any = {"success": True}
        if path == "/generate":
            body = {"text": "x", "meta_info": {"finish_reason": {"type": "length"}}}
        return web.json_response(json.loads(json.dumps(body)))
