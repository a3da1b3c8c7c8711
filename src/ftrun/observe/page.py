"""The status page's HTTP server: one static page and `/status.json`, read-only.

GET and HEAD only (any other method: 501 from the standard library's handler), two paths, no
query handling: nothing a request says can change the job. The document is rebuilt at most
once per `refresh` seconds however many browsers poll it (`CachedStatus`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from importlib import resources
from typing import Any

from ftrun.observe.http_servers import PageServer, start_in_thread

log = logging.getLogger("ftrun.agent")

PAGE = resources.files("ftrun.observe").joinpath("status.html").read_bytes()


class CachedStatus:
    """The status document, rebuilt when older than `refresh` seconds, or than `SHARE` times
    its last build took (one builder at a time): however many browsers poll, building it
    takes at most 1 / SHARE of a core of the agent serving it (a 1,024-node job's status
    takes about 0.6 s to build on a 2-core VM: rebuilt every 2.4 s, not every second)."""

    SHARE = 4.0

    def __init__(
        self,
        build: Callable[[], Mapping[str, Any]],
        refresh: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._build, self._refresh, self._clock = build, refresh, clock
        self._lock = threading.Lock()
        self._at: float | None = None
        self._took = 0.0
        self._doc: Mapping[str, Any] | None = None

    def get(self) -> Mapping[str, Any]:
        with self._lock:
            now = self._clock()
            fresh_for = max(self._refresh, self.SHARE * self._took)
            if self._doc is None or self._at is None or now - self._at >= fresh_for:
                self._doc = self._build()
                self._at, self._took = now, self._clock() - now
            return self._doc

    def last(self) -> Mapping[str, Any] | None:
        """The last document built, without building one (for the metrics)."""
        return self._doc


def serve(status: CachedStatus, bind: str, port: int) -> PageServer:
    """Start serving in a daemon thread; `server.server_address` has the port picked."""

    class Handler(_ReadOnlyHandler):
        document = status

    return start_in_thread(PageServer((bind, port), Handler), "ftrun-status-page")


class _ReadOnlyHandler(BaseHTTPRequestHandler):
    document: CachedStatus
    server_version = "ftrun-status"

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", PAGE, body)
        elif path == "/status.json":
            try:
                data = json.dumps(self.document.get(), default=str).encode()
            except Exception as exc:  # the store went away, or a bug: say so, keep serving
                log.warning("status page: cannot build the status: %r", exc)
                self._send(503, "text/plain", f"status unavailable: {exc}\n".encode(), body)
                return
            self._send(200, "application/json", data, body)
        elif path == "/favicon.ico":  # browsers ask for it on every load: no error for that
            self._send(204, "image/x-icon", b"", body)
        else:
            self._send(404, "text/plain", b"not found\n", body)

    def _send(self, code: int, kind: str, data: bytes, body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header(
            "Content-Security-Policy",
            "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'",
        )
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return None  # a browser polling every 2 s must not fill the agent's log
