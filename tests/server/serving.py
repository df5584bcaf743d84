"""A real kembed server for tests: the whole app on its own event loop in a thread, on free
loopback ports, with small buckets so warmup takes seconds."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Coroutine
from typing import Any, TypeVar

from kembed.app import KembedServer
from kembed.config import Settings

T = TypeVar("T")

FAST = {
    "buckets": "16,32,64,128,256",
    "max_batch_size": 16,
    "max_tokens_per_batch": 2048,
    "grpc_port": 0,
    "http_port": 0,
}


class ServerThread:
    def __init__(self, **overrides: Any) -> None:
        self.settings = Settings.from_env({}, **{**FAST, **overrides})
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        self.server = self.call(self._create())  # gRPC's aio server binds to the loop it is made on

    async def _create(self) -> KembedServer:
        return KembedServer(self.settings)

    def start(self, wait_ready: bool = True) -> ServerThread:
        self.call(self.server.start())
        if wait_ready:
            self.call(self.server.wait_ready(), timeout=300)
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop(grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    def http(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.server.http.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def health(self) -> dict[str, Any]:
        status, body = self.http("/health")
        assert status == 200
        return dict(json.loads(body))
