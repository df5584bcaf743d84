"""Health and metrics over HTTP on their own port, served from a thread of their own so probes
answer even while the event loop is busy: /livez, /readyz, /health (JSON) and /metrics."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kembed.contract import HEALTH_PATH, LIVEZ_PATH, METRICS_PATH, READYZ_PATH

log = logging.getLogger(__name__)


class HealthServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        health: Callable[[], dict[str, Any]],
        registry: CollectorRegistry,
    ) -> None:
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            LIVEZ_PATH: lambda: _probe(live()),
            READYZ_PATH: lambda: _probe(ready()),
            HEALTH_PATH: lambda: (200, "application/json", json.dumps(health()).encode()),
            METRICS_PATH: lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                status, content_type, body = route() if route else (404, "text/plain", b"not found\n")
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not news
                log.debug(format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kembed-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _probe(ok: bool) -> tuple[int, str, bytes]:
    return (200, "text/plain", b"ok\n") if ok else (503, "text/plain", b"not ready\n")
