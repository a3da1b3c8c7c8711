"""The agent's two HTTP servers (status page, metrics) as threads that never print a traceback.

`socketserver` prints a traceback to stderr for any error raised while a request is handled,
and a client that leaves before its answer is written raises one (`BrokenPipeError`): a port
scanner, a browser tab closed mid-poll, a Prometheus scrape timed out. Here such an error is
one DEBUG line (a client gone), or one WARNING line (anything else), and the server goes on.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from http.server import ThreadingHTTPServer
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

log = logging.getLogger("ftrun.agent")


class _OneLineErrors:
    """`handle_error` as one log line."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        gone = isinstance(exc, ConnectionError | TimeoutError)
        log.log(logging.DEBUG if gone else logging.WARNING, "HTTP request from %s ended: %r",
                client_address[0] if client_address else "?", exc)  # fmt: skip


class PageServer(_OneLineErrors, ThreadingHTTPServer):
    daemon_threads = True


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None  # every scrape would be a line of the agent's log


def start_in_thread(server: Any, name: str) -> Any:
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def serve_metrics(registry: Any, bind: str, port: int) -> Any:
    """prometheus_client's exposition of `registry` on `bind`:`port`, in a daemon thread."""
    from prometheus_client import make_wsgi_app

    class Server(_OneLineErrors, ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)[0][0]

    server = make_server(bind, port, make_wsgi_app(registry), Server, _SilentHandler)
    return start_in_thread(server, "ftrun-metrics")
