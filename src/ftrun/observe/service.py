"""The live view as a node service: metrics on every agent, the status page on group rank 0.

- Every agent with `--ft-metrics-port` serves `NodeMetrics` (its events, read as they are
  written, and its ranks' progress) through `prometheus_client`'s own HTTP server.
- With `--ft-status-port`, every agent copies its events and its ranks' progress into the
  store (`feed.FeedWriter`, from a thread of its own: the agent never waits on it), and the
  agent of group rank 0 serves the page from every node's copy (`feed.FeedReader`). When the
  group rank 0 moves to another node (its node was lost or left), the page moves with it.

The endpoints go to the log and to the cycle info every worker reads (`metrics`, `status`).
Nothing here can stop training: a failure to serve is logged, a store error retried.
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http.server import ThreadingHTTPServer
from typing import Any

from ftrun.config.observe import ObserveConfig
from ftrun.eventlog.job_status import job_status
from ftrun.observe.feed import FeedReader, FeedWriter
from ftrun.observe.http_servers import serve_metrics
from ftrun.observe.metrics import NodeMetrics
from ftrun.observe.page import CachedStatus, serve
from ftrun.rank_monitor.records import ProgressSnapshot
from ftrun.rendezvous.control import job_control
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService, ServiceContext

log = logging.getLogger("ftrun.agent")

_EVENTS_BATCH_S = 0.2
"""Events reach the store within this long (batched: one count update per batch)."""


class ObserveService(NodeService):
    name = "live view"

    def __init__(self, config: ObserveConfig, context: ServiceContext) -> None:
        self._config = config
        self._job = context.config.rendezvous.run_id
        self._node = context.node
        self._store, self._prefix = context.store, job_control(context.store, self._job).prefix
        self._progress = context.progress
        self._describe = context.describe
        self._page: ThreadingHTTPServer | None = None
        self._status: CachedStatus | None = None
        self._metrics_server: Any = None
        self.metrics = NodeMetrics(self._job, self._node, self._progress, self._page_status,
                                   gpus=context.gpus)  # fmt: skip
        context.read_events(self.metrics.apply)
        self._feed: FeedThread | None = None
        if config.status_port is not None:
            writer = FeedWriter(self._store, self._prefix, self._node)
            self._feed = FeedThread(writer, self._progress, config.publish_interval)
            context.read_events(self._feed.queue.put)
            self._feed.start()
        if config.metrics_port is not None:
            self._serve_metrics(config.metrics_port)

    def _serve_metrics(self, port: int) -> None:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.metrics)
        start = functools.partial(serve_metrics, registry, self._config.bind, port)
        self._metrics_server = self._listen("metrics", "metrics", "/metrics", port, start)

    def on_round(self, rnd: Round) -> None:
        if self._feed is not None:
            if rnd.group_rank == 0:
                self._serve_page()
            elif self._page is not None:
                moved = rnd.nodes[0].node
                log.info("status page: group rank 0 is now %s; it serves the page", moved)
                self._stop_page()

    def _page_status(self) -> Mapping[str, Any] | None:
        return self._status.last() if self._status is not None else None

    def _serve_page(self) -> None:
        if self._page is not None:
            return
        reader = FeedReader(self._store, self._prefix)

        def build() -> Mapping[str, Any]:
            events, live = reader.read()
            return job_status(self._job, events, live, time.time())

        status = self._status = CachedStatus(build)
        port, bind = self._config.status_port or 0, self._config.bind
        self._page = self._listen(
            "status page", "status", "/", port, lambda: serve(status, bind, port)
        )

    def _listen(self, what: str, field: str, path: str, port: int, start: Callable[[], Any]) -> Any:
        """Start one of the two servers; its URL goes to the log and to the cycle info's `field`.
        A port that cannot be had is an ERROR line, not the job's end."""
        try:
            server = start()
        except OSError as exc:
            log.error("%s: cannot listen on %s:%d: %s", what, self._config.bind, port, exc)
            return None
        url = _url(self._config.bind, server.server_address[1], path)
        log.info("%s: %s", what, url)
        self._describe(field, url)
        return server

    def _stop_page(self) -> None:
        if self._page is not None:
            self._page.shutdown()
            self._page.server_close()
            self._page = None
            self._describe("status", None)

    def close(self) -> None:
        if self._feed is not None:
            self._feed.stop()
        self._stop_page()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


class FeedThread:
    """The thread that copies the node's events and progress into the store."""

    def __init__(
        self, writer: FeedWriter, progress: Callable[[], list[ProgressSnapshot]], interval: float
    ) -> None:
        self.queue: queue.SimpleQueue[Mapping[str, Any]] = queue.SimpleQueue()
        self._writer, self._progress, self._interval = writer, progress, interval
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._registered = False
        self._pending: list[Mapping[str, Any]] = []
        """Events taken from the queue and not yet in the store (kept across store errors)."""
        self._cycle = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ftrun-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        next_live = 0.0
        while True:
            self._guarded(self._publish_events)
            if time.monotonic() >= next_live and self._registered:
                self._guarded(self._publish_live)
                next_live = time.monotonic() + self._interval
            if self._stopping.wait(_EVENTS_BATCH_S):
                break
        self._guarded(self._publish_events)  # the last ones: the exit, the stop

    def _publish_events(self) -> None:
        if not self._registered:
            self._writer.register()
            self._registered = True
        while not self.queue.empty():  # this thread is its only reader
            self._pending.append(self.queue.get_nowait())
        if self._pending:
            self._cycle = int(self._pending[-1].get("cycle", self._cycle))
            self._writer.events(self._pending)  # rewrites the same keys after an error
            self._pending = []

    def _publish_live(self) -> None:
        now_mono, now = time.monotonic(), time.time()
        progress = [
            [r.rank, r.last_iteration,
             None if r.last_progress is None else round(max(now_mono - r.last_progress, 0.0), 3)]
            for r in self._progress()
        ]  # fmt: skip
        self._writer.live({"ts": now, "cycle": self._cycle, "progress": progress})

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
            self._failing = False
        except Exception as exc:  # the store may be gone (its host node was lost): retry
            if not self._failing:
                log.warning("status feed: cannot write to the store: %r (retrying)", exc)
            self._failing = True


def _url(bind: str, port: int, path: str) -> str:
    host = bind if bind not in ("0.0.0.0", "::", "") else socket.gethostname()
    return f"http://{host}:{port}{path}"


def observe_service(context: ServiceContext) -> NodeService:
    """The builder's factory; a no-op service when neither port is set."""
    config = context.config.observe
    return ObserveService(config, context) if config.enabled else NodeService()
