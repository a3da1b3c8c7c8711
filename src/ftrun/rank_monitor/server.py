"""RankMonitorServer: one per node, watches every local rank, reports hangs as verdicts.

One thread owns the ZeroMQ ROUTER socket and the deadline heap; it sleeps exactly until the next
deadline or message, so a hang is found within milliseconds of its deadline. The hung rank's
stacks are then captured off that thread (`capture`), and its verdict posted once they are in:
a slow capture never delays another rank's deadline. A stopped rank (`process_state`) is not
asked: it could never answer, and its verdict, marked `stopped`, must not wait for it. The
owner (the agent, or a test) talks to it through `expect_rank`/`forget_all` (kept in a
`RankRegistry`, which admits a rank's HELLO only from the process spawned for it) and receives
`Verdict`s through a callback (default: the `verdicts` queue).

It also notes training progress for reports: each registration's first progress (heartbeat or
section end) goes to the `on_progress` callback as a `FirstProgress`, and `progress_snapshot()`
tells where every rank last was (before the owner stops the workers, say). A registered rank's
workload control request goes to the `on_control` callback as a `WorkloadControl`, a
straggler detector's section timings to `on_timings` as a `TimingBatch` (see `timings`), and a
wrapped rank's in-process report to `on_inprocess` as the `InprocessNote` it sent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from ftrun.config.monitor import RankMonitorConfig
from ftrun.environment import Env
from ftrun.errors import ProtocolError
from ftrun.rank_monitor import protocol as wire
from ftrun.rank_monitor import stacks
from ftrun.rank_monitor.capture import Capture, StackCapturer, capture_stacks
from ftrun.rank_monitor.deadlines import Deadlines
from ftrun.rank_monitor.process_state import cannot_act, status_of
from ftrun.rank_monitor.records import FirstProgress, ProgressSnapshot, Verdict
from ftrun.rank_monitor.registry import Peer, RankRegistry, is_self_or_descendant
from ftrun.rank_monitor.timings import TimingBatch, TimingSenders
from ftrun.rank_monitor.tracker import (
    NotReadyError,
    Overdue,
    RankProgress,
    floored,
    initial_timeouts,
)
from ftrun.rank_monitor.workload import WorkloadAction, WorkloadControl

log = logging.getLogger("ftrun.rank_monitor")

_MAX_DRAIN = 512  # messages handled per batch, so a flood cannot hold the lock for long
_MAX_SLEEP_MS = 1000
_CATCH_UP_S = 0.5
_Hung = list[tuple[Peer, Overdue, float]]
"""Ranks judged hung at once: each registration, why, and when it was judged."""
_Noted = tuple[Callable[..., None] | None, object, tuple[bytes, int] | None]
"""For the owner: the callback, what it gets, and whom to acknowledge (identity, seq) once it
took it (a control request) or not."""


class RankMonitorServer:
    """Serves all local ranks of one node over `ipc://` in a 0700 per-job directory."""

    def __init__(
        self,
        config: RankMonitorConfig,
        job_dir: Path | None = None,
        on_verdict: Callable[[Verdict], None] | None = None,
        on_progress: Callable[[FirstProgress], None] | None = None,
        on_control: Callable[[WorkloadControl], None] | None = None,
        on_timings: Callable[[TimingBatch], None] | None = None,
        on_inprocess: Callable[[wire.InprocessNote], None] | None = None,
        capture: Capture = capture_stacks,
        status: Callable[[int], str | None] = status_of,
    ) -> None:
        """The callbacks run on the monitor thread (`on_verdict`: on a capture thread): they
        must only enqueue. Without `on_control`, workload control requests are refused;
        without `on_timings` (`on_inprocess`), timings (in-process reports) are dropped
        uncounted. `capture` takes the stacks and `status` reads a process's state
        (`process_state.status_of`); fakes in tests."""
        self.config = config
        self.job_dir = Path(job_dir or tempfile.mkdtemp(prefix="ftrun-"))
        self.job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.job_dir, 0o700)  # mkdir's mode is masked; the socket must stay private
        (self.job_dir / "stacks").mkdir(mode=0o700, exist_ok=True)
        self.address = f"ipc://{self.job_dir / 'monitor.sock'}"
        self.verdicts: queue.SimpleQueue[Verdict] = queue.SimpleQueue()
        self._on_verdict = on_verdict or self.verdicts.put
        self._on_progress = on_progress
        self._on_control = on_control
        self._on_timings = on_timings
        self._on_inprocess = on_inprocess
        self._capturer = StackCapturer(capture, config.stack_signal, config.stack_capture_timeout)
        self._status = status
        self._senders = TimingSenders(is_self_or_descendant)  # timings and in-process notes
        self._lock = threading.Lock()
        self._ranks = RankRegistry()  # who may register, and who did
        self._noted: list[_Noted] = []  # under the lock, delivered after it
        self._deadlines = Deadlines()
        self._ctx = zmq.Context.instance()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dropped_messages = 0

    # ---- owner API -------------------------------------------------------------------------

    def start(self) -> RankMonitorServer:
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.bind(self.address)
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_send = self._ctx.socket(zmq.PAIR)
        wake_addr = f"inproc://ftrun-monitor-wake-{id(self)}"
        self._wake_recv.bind(wake_addr)
        self._wake_send.connect(wake_addr)
        self._thread = threading.Thread(target=self._serve, name="rank-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake_send.send(b"")
        self._thread.join()
        self._thread = None
        self._capturer.close()
        for sock in (self._sock, self._wake_recv, self._wake_send):
            sock.close(linger=0)

    def __enter__(self) -> RankMonitorServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def expect_rank(self, rank: int, pid: int) -> None:
        """Allow `rank` to register from process `pid` (or a descendant of it)."""
        with self._lock:
            self._ranks.expect(rank, pid)

    def forget_all(self) -> None:
        """Stop watching every rank (the owner stopped its workers)."""
        with self._lock:
            self._ranks.clear()
            self._senders.clear()

    def progress_snapshot(self) -> list[ProgressSnapshot]:
        """Where each expected rank's current registration got to, in rank order: taken right
        before the owner stops its workers, it holds their last progress."""
        with self._lock:
            return self._ranks.snapshot()

    def worker_env(self) -> dict[str, str]:
        """The environment variables a worker's RankMonitorClient needs."""
        return {
            Env.MONITOR_ADDR: self.address,
            Env.JOB_DIR: str(self.job_dir),
            Env.STACK_SIGNAL: str(int(self.config.stack_signal)),
        }

    # ---- server thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        while not self._stopping:
            events = dict(poller.poll(self._sleep_ms()))
            if self._sock in events:
                self._drain()
            due = self._deadlines.next()
            if due is not None and due <= time.monotonic():
                self._catch_up()
                self._fire_due()

    def _catch_up(self) -> None:
        """Read what is already queued before judging: behind a flood of messages, a rank's
        section end may be waiting in the socket, and a late read must not become a false
        verdict. Bounded, so that a flood delays a true verdict by at most `_CATCH_UP_S`."""
        give_up_at = time.monotonic() + _CATCH_UP_S
        while self._drain() and time.monotonic() < give_up_at:
            pass

    def _sleep_ms(self) -> int:
        due = self._deadlines.next()
        if due is None:
            return _MAX_SLEEP_MS
        delay = due - time.monotonic()
        # Round up: waking a hair early would only re-arm, waking late costs latency.
        return max(0, min(_MAX_SLEEP_MS, int(delay * 1000) + 1))

    def _drain(self) -> bool:
        """Handle up to `_MAX_DRAIN` queued messages; True if more may be waiting."""
        for _ in range(_MAX_DRAIN):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            now = time.monotonic()
            with self._lock:
                self._handle(frames, now)
            if self._noted:
                self._deliver()
        return True

    def _deliver(self) -> None:
        """Hand the owner what `_handle` noted; a control request is acknowledged once its
        callback took it, so the owner has it when the rank's call returns."""
        noted, self._noted = self._noted, []
        for callback, item, ack in noted:
            if ack is not None:
                log.info("%s", item.describe())  # type: ignore[attr-defined]
            ok = self._call(callback, item)
            if ack is not None:
                self._reply(*ack, error="" if ok else "the launcher did not take it")

    def _call(self, callback: Callable[..., None] | None, item: object) -> bool:
        if callback is not None:
            try:
                callback(item)
                return True
            except Exception:  # the owner's bug must not stop the deadline loop
                log.exception("the %s callback failed", type(item).__name__)
        return False

    def _handle(self, frames: list[bytes], now: float) -> None:
        if len(frames) != 2:
            self._drop(f"{len(frames)} frames instead of 2")
            return
        identity, payload = frames
        try:
            message = wire.decode(payload)
        except ProtocolError as exc:
            self._drop(str(exc))
            return
        if isinstance(message, wire.Hello):
            self._hello(identity, message, now)
            return
        if isinstance(message, wire.Timings):
            self._note_timings(identity, message, now)
            return
        if isinstance(message, wire.InprocessNote):
            if self._on_inprocess and self._sent_by_a_worker(identity, message.rank, message.pid):
                self._noted.append((self._on_inprocess, message, None))
            return
        peer = self._ranks.peers.get(identity)
        if peer is None:
            self._drop(f"{type(message).__name__} from an unregistered peer")
            if hasattr(message, "seq"):
                self._reply(identity, message.seq, error="not registered: send HELLO first")
            return
        self._dispatch(identity, peer, message, now)

    def _dispatch(self, identity: bytes, peer: Peer, message: wire.Message, now: float) -> None:
        progress = peer.progress
        match message:
            case wire.Heartbeat(iteration=iteration):
                if progress.heartbeat(now, iteration):
                    self._note_first_progress(peer, now, iteration)
            case wire.SectionStart(name=name):
                progress.start_section(name, now)
            case wire.SectionEnd(name=name, iteration=iteration):
                if progress.end_section(name, now, iteration):
                    self._note_first_progress(peer, now, iteration)
            case wire.EndAllSections():
                if progress.end_all_sections(now):
                    self._note_first_progress(peer, now, None)
            case wire.CalcTimeouts():
                self._calculate(identity, progress, message)
            case wire.SetTimeouts(seq=seq, timeouts=timeouts):
                progress.timeouts = floored(self.config, timeouts)
                self._reply(identity, seq, data=progress.timeouts.to_wire())
            case wire.Control(seq=seq, action=action, description=text):
                p, what = progress, WorkloadAction(action)
                control = WorkloadControl(p.rank, p.pid, peer.spawned_pid, what, text, now)
                self._noted.append((self._on_control, control, (identity, seq)))
            case wire.Goodbye():
                del self._ranks.peers[identity]
                return
            case _:
                self._drop(f"unexpected {type(message).__name__}")
                return
        self._arm(identity, progress)

    def _note_first_progress(self, peer: Peer, now: float, iteration: int | None) -> None:
        p = peer.progress
        note = FirstProgress(p.rank, p.pid, peer.spawned_pid, now, iteration)
        self._noted.append((self._on_progress, note, None))

    def _note_timings(self, identity: bytes, message: wire.Timings, now: float) -> None:
        if self._on_timings is None:
            return
        spawned = self._sent_by_a_worker(identity, message.rank, message.pid)
        if spawned is None:
            return
        batch = TimingBatch(message.rank, spawned, message.sections, now, message.settings)
        self._noted.append((self._on_timings, batch, None))

    def _sent_by_a_worker(self, identity: bytes, rank: int, pid: int) -> int | None:
        """The pid spawned for `rank` if `pid` is it or its descendant (once per connection),
        else None, the message dropped with a log line."""
        spawned = self._senders.spawned_pid(identity, rank, pid, self._ranks.expected.get(rank))
        if spawned is None:
            self._drop(f"a message from rank {rank} pid {pid}, not spawned here")
        return spawned

    def _hello(self, identity: bytes, hello: wire.Hello, now: float) -> None:
        spawned_pid = self._ranks.admitted_pid(hello.rank, hello.pid)
        if spawned_pid is None:
            self._drop(f"HELLO from rank {hello.rank} pid {hello.pid}, which was not spawned here")
            self._reply(identity, hello.seq, error=f"rank {hello.rank} is not expected here")
            return
        progress = RankProgress(hello.rank, hello.pid, now, initial_timeouts(self.config))
        warmup = hello.warmup_iterations
        progress.warmup_iterations = self.config.num_warmup_iterations if warmup is None else warmup
        self._ranks.register(identity, progress, spawned_pid)
        self._reply(identity, hello.seq, data=progress.timeouts.to_wire())
        self._arm(identity, progress)

    def _calculate(self, identity: bytes, progress: RankProgress, req: wire.CalcTimeouts) -> None:
        try:
            calculated = progress.calculated_timeouts(
                self.config.safety_factor, req.heartbeat, req.sections, req.out_of_section,
                req.skip_if_not_ready,
            )  # fmt: skip
            progress.timeouts = floored(self.config, calculated)
        except NotReadyError as exc:
            self._reply(identity, req.seq, error=str(exc))
            return
        self._reply(identity, req.seq, data=progress.timeouts.to_wire())

    def _reply(self, identity: bytes, seq: int, error: str = "", data: object = None) -> None:
        frame = wire.encode(wire.Reply(seq=seq, ok=not error, error=error, data=data))
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([identity, frame], zmq.NOBLOCK)

    def _drop(self, why: str) -> None:
        self.dropped_messages += 1
        # A flooding peer must not flood the launcher log too: the first few, then a sample.
        if self.dropped_messages <= 10 or self.dropped_messages % 1000 == 0:
            log.warning("dropped monitor message #%d: %s", self.dropped_messages, why)

    # ---- deadlines and hang verdicts: `_fire_due` judges, `_report` captures, `_post` posts --

    def _arm(self, identity: bytes, progress: RankProgress) -> None:
        """Arm the rank's earliest deadline (see `deadlines`: only an earlier one is pushed)."""
        overdue = progress.next_overdue()
        if overdue is not None:
            self._deadlines.arm(identity, progress.rank, overdue.deadline)

    def _fire_due(self) -> None:
        hung: _Hung = []
        with self._lock:
            for identity in self._deadlines.pop_due(time.monotonic()):
                peer = self._ranks.peers.get(identity)
                if peer is None:
                    continue
                now = time.monotonic()
                overdue = peer.progress.next_overdue()
                if overdue is not None and overdue.deadline <= now:
                    del self._ranks.peers[identity]  # one verdict per registration
                    hung.append((peer, overdue, now))
                else:
                    self._arm(identity, peer.progress)
        if hung:
            self._report(hung)

    def _report(self, hung: _Hung) -> None:
        """Capture the hung ranks' stacks off this thread; their verdicts follow (`_post`).
        A stopped rank is not asked (a signal would wait, pending, until its SIGCONT): the
        capture would only wait out its timeout."""
        progresses = [peer.progress for peer, _, _ in hung]
        files = [stacks.stack_file(self.job_dir, p.rank, p.pid) for p in progresses]
        stopped = {p.pid for p in progresses if cannot_act(self._status(p.pid))}
        targets = [(p.pid, f) for p, f in zip(progresses, files, strict=True)
                   if p.pid not in stopped]  # fmt: skip
        self._capturer.submit(targets, lambda dumps: self._post(hung, files, dumps, stopped))

    def _post(self, hung: _Hung, files: list[Path], dumps: dict[Path, str],
              stopped: set[int]) -> None:  # fmt: skip
        for (peer, overdue, detected_at), path in zip(hung, files, strict=True):
            progress = peer.progress
            with self._lock:
                forgotten = not self._ranks.is_current(peer)
            if forgotten:  # the owner stopped this worker while its stacks were collected
                continue
            stack = dumps.get(path, "")
            verdict = Verdict(
                rank=progress.rank,
                pid=progress.pid,
                worker_pid=peer.spawned_pid,
                kind=overdue.kind,
                section=overdue.section,
                timeout=overdue.deadline - overdue.since,
                waited=detected_at - overdue.since,
                deadline=overdue.deadline,
                detected_at=detected_at,
                stack_file=path if dumps.get(path) else None,
                stack=stack,
                stopped=progress.pid in stopped,
                stuck=stacks.where_stuck(stack),
            )
            log.info("%s", verdict.describe())
            self._on_verdict(verdict)
