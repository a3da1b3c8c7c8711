"""RankMonitorClient: the thin in-worker side of the heartbeat path.

Method names and arguments match NVIDIA Resiliency Extension's client (0.7: `hb_timeouts`,
`section_timeouts`, `is_initialized`, its saved state), so switching is an import change.
Heartbeats and section marks are fire-and-forget: one non-blocking ZeroMQ send of a frame that
was encoded once. Only `init_workload_monitoring`, the timeout calculations,
`load_state_dict` and `send_workload_control_request` wait for the server (with a timeout).

`send_workload_control_request(WorkloadControlRequest(action, description))` asks the launcher
to act on the workload (see `WorkloadAction`); it returns once the node's agent has the request.

`send_heartbeat` and `end_section` take an optional `iteration`, the training step the rank has
just completed: with it, `ftrun report` counts the work redone after a restart. Without it,
the frames (and the cost) are those of before; with it, a few more bytes are appended.

The launcher sets the environment the client reads (see `ftrun.config.monitor`):
`FTRUN_MONITOR_ADDR`, `FTRUN_IPC_DIR`, `FTRUN_STACK_SIGNAL` and torchrun's `RANK`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import operator
import os
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ftrun.client_lib import flight, timeouts
from ftrun.config.monitor import ENV_RANK
from ftrun.environment import Env
from ftrun.errors import ProtocolError, RankMonitorClientError
from ftrun.rank_monitor import protocol as wire
from ftrun.rank_monitor.stacks import stack_file
from ftrun.rank_monitor.workload import WorkloadControlRequest

REQUEST_TIMEOUT_S = float(os.environ.get(Env.MONITOR_REQUEST_TIMEOUT, "30"))
# One packer for every iteration: `packb` builds a Packer per call, ten times the cost. Its
# `pack` is C code that holds the GIL, so threads sharing it cannot interleave.
_pack_int = msgpack.Packer().pack


class RankMonitorClient:
    """Reports one rank's progress to its node's RankMonitorServer."""

    def __init__(self) -> None:
        self._sock: zmq.Socket | None = None
        self._ctx: zmq.Context | None = None
        self._heartbeat_frame = wire.encode(wire.Heartbeat())
        self._heartbeat_prefix = _prefix(wire.Heartbeat(0))
        self._end_all_frame = wire.encode(wire.EndAllSections())
        # name -> (start frame, end frame, end frame's prefix before an iteration)
        self._section_frames: dict[str, tuple[bytes, bytes, bytes]] = {}
        self._open_sections: set[str] = set()
        self._seq = 0
        self._timeouts: wire.Timeouts | None = None
        self._calculated: dict[str, Any] = {}
        self.dropped = 0

    # ---- lifecycle -------------------------------------------------------------------------

    def init_workload_monitoring(self, num_warmup_iters: int | None = None) -> None:
        """Connect to the node's monitor and register this rank; starts its timeouts.

        `num_warmup_iters` (NVRx 0.7): this rank's first N `step` sections are judged with the
        `warmup` section timeout, where the launcher has one (default: the launcher's
        --ft-num-warmup-iterations)."""
        if num_warmup_iters is not None and (
            type(num_warmup_iters) is not int or not 0 <= num_warmup_iters <= wire.MAX_ITERATION
        ):
            raise RankMonitorClientError("num_warmup_iters must be a non-negative integer")
        if self._sock is not None:
            raise RankMonitorClientError("init_workload_monitoring() was already called")
        address, job_dir, stack_signal, rank = _env()
        self._register_stack_dump(job_dir, rank, stack_signal)
        flight.start_listener(job_dir, rank)
        self._ctx = _background_context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(address)
        self._sock = sock
        try:
            hello = wire.Hello(self._next_seq(), rank, os.getpid(), num_warmup_iters)
            reply = self._request(hello)
            self._timeouts = wire.Timeouts.from_wire(reply)
            if self._calculated:
                self._apply_saved()
        except BaseException:
            self._close()
            raise

    def shutdown_workload_monitoring(self) -> None:
        """Deregister cleanly; a no-op when not initialized."""
        if self._sock is None:
            return
        self._send(wire.encode(wire.Goodbye()))
        self._close()

    # ---- the hot path ------------------------------------------------------------------------

    def send_heartbeat(self, iteration: int | None = None) -> None:
        """The rank is alive and made progress; `iteration`: the step it has just completed."""
        sock = self._sock
        if sock is None:
            raise RankMonitorClientError("send_heartbeat() before init_workload_monitoring()")
        if iteration is None:
            frame = self._heartbeat_frame
        else:
            frame = self._heartbeat_prefix + _packed_iteration(iteration)
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def start_section(self, section: str) -> None:
        frames = self._section_frames.get(section) or self._encode_section(section)
        if section in self._open_sections:
            raise RankMonitorClientError(f"section {section!r} is already open")
        self._send(frames[0])
        self._open_sections.add(section)

    def end_section(self, section: str, iteration: int | None = None) -> None:
        """Leave `section`; `iteration`: the step the rank has just completed, if known."""
        if section not in self._open_sections:
            raise RankMonitorClientError(f"end_section({section!r}) but that section is not open")
        frames = self._section_frames[section]
        self._send(frames[1] if iteration is None else frames[2] + _packed_iteration(iteration))
        self._open_sections.discard(section)

    def end_all_sections(self) -> None:
        self._send(self._end_all_frame)
        self._open_sections.clear()

    # ---- timeouts ----------------------------------------------------------------------------

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Set heartbeat timeouts to safety_factor x the longest observed interval."""
        return self._calculate(True, (), False, skip_if_not_ready)

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: Iterable[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Set section (and out-of-section) timeouts from observed durations."""
        names = None if selected_sections is None else tuple(selected_sections)
        return self._calculate(False, names, calc_out_of_section, skip_if_not_ready)

    def state_dict(self) -> dict[str, Any]:
        """The calculated timeouts, to save with a checkpoint, in NVRx's form
        (`{"current_timeouts": ...}`, plain JSON-able data): NVRx loads it too."""
        return timeouts.to_nvrx_state(self._timeouts, self._calculated)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore calculated timeouts (NVRx's saved form, or ftrun's compact one); applied now
        if initialized, else at init."""
        self._calculated = timeouts.from_state(state)
        if self._sock is not None:
            self._apply_saved()

    def calculated_timeouts(self) -> timeouts.Calculated:
        """The calculated timeouts in ftrun's compact form (see `timeouts.Calculated`)."""
        return {key: (dict(v) if isinstance(v, dict) else v) for key, v in self._calculated.items()}

    # ---- NVRx's read-only views ------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return self._sock is not None

    @property
    def hb_timeouts(self) -> timeouts.HeartbeatTimeouts | None:
        """The heartbeat timeouts in force (None before `init_workload_monitoring`)."""
        return self._views()[0]

    @property
    def section_timeouts(self) -> timeouts.SectionTimeouts | None:
        """The section timeouts in force (None before `init_workload_monitoring`)."""
        return self._views()[1]

    def _views(self) -> tuple[timeouts.HeartbeatTimeouts | None, timeouts.SectionTimeouts | None]:
        if self._timeouts is None:
            return None, None
        return timeouts.views(self._timeouts, self._calculated)

    # ---- workload control --------------------------------------------------------------------

    def send_workload_control_request(self, req: WorkloadControlRequest) -> None:
        """Ask the launcher to act on the workload: continue, exclude this node, or shut the
        job down. Returns once the node's agent has the request, so the rank may exit right
        after; raises `RankMonitorClientError` if it was not delivered. (`req`: NVRx's name.)"""
        if not isinstance(req, WorkloadControlRequest):
            raise RankMonitorClientError(
                f"expected a WorkloadControlRequest, not {type(req).__name__}"
            )
        self._require_init("send_workload_control_request()")
        self._request(wire.Control(self._next_seq(), req.action.value, req.description))

    # ---- internals ---------------------------------------------------------------------------

    def _calculate(
        self,
        heartbeat: bool,
        sections: tuple[str, ...] | None,
        out_of_section: bool,
        skip_if_not_ready: bool,
    ) -> bool:
        self._require_init("calculating timeouts")
        request = wire.CalcTimeouts(
            self._next_seq(), heartbeat, sections, out_of_section, skip_if_not_ready
        )
        before = self._timeouts
        after = wire.Timeouts.from_wire(self._request(request))
        self._timeouts = after
        if heartbeat:
            self._calculated["heartbeat"] = {
                "initial": after.initial_heartbeat,
                "subsequent": after.heartbeat,
            }
        if changed := {n: t for n, t in after.sections.items() if before.sections.get(n) != t}:
            self._calculated.setdefault("sections", {}).update(changed)
        if out_of_section and after.out_of_section != before.out_of_section:
            self._calculated["out_of_section"] = after.out_of_section
        return after != before

    def _apply_saved(self) -> None:
        assert self._timeouts is not None
        merged = timeouts.in_force(self._timeouts, self._calculated)
        reply = self._request(wire.SetTimeouts(self._next_seq(), merged))
        self._timeouts = wire.Timeouts.from_wire(reply)

    def _encode_section(self, name: str) -> tuple[bytes, bytes]:
        if not isinstance(name, str) or not 0 < len(name) <= wire.MAX_NAME_LEN:
            raise RankMonitorClientError(
                f"a section name must be a string of 1..{wire.MAX_NAME_LEN} characters"
            )
        frames = (
            wire.encode(wire.SectionStart(name)),
            wire.encode(wire.SectionEnd(name)),
            _prefix(wire.SectionEnd(name, 0)),
        )
        self._section_frames[name] = frames
        return frames

    def _send(self, frame: bytes) -> None:
        sock = self._require_init("sending to the monitor")
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def _request(self, message: wire.Message) -> Any:
        sock = self._require_init("a monitor request")
        sock.send(wire.encode(message))
        seq = message.seq  # type: ignore[union-attr]
        while sock.poll(int(REQUEST_TIMEOUT_S * 1000)):
            try:
                reply = wire.decode(sock.recv())
            except ProtocolError as exc:
                raise RankMonitorClientError(f"bad reply from the monitor: {exc}") from None
            if isinstance(reply, wire.Reply) and reply.seq == seq:
                if not reply.ok:
                    raise RankMonitorClientError(f"the monitor refused: {reply.error}")
                return reply.data
        raise RankMonitorClientError(f"no answer from the monitor within {REQUEST_TIMEOUT_S}s")

    def _require_init(self, what: str) -> zmq.Socket:
        if self._sock is None:
            raise RankMonitorClientError(f"{what} before init_workload_monitoring()")
        return self._sock

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _register_stack_dump(self, job_dir: Path, rank: int, sig: signal.Signals) -> None:
        path = stack_file(job_dir, rank, os.getpid())
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # A raw descriptor, left open and registered after shutdown on purpose: a late dump
        # request must neither kill the process nor write into a reused descriptor.
        # Unregistered first: faulthandler skips installing its handler for a signal it has
        # registered before, even if someone reset the signal since (Lightning restores every
        # handler it saw at the end of a fit, SIG_DFL for ours), and SIG_DFL would kill the rank.
        faulthandler.unregister(sig)
        faulthandler.register(sig, file=fd, all_threads=True, chain=False)

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = None
        self._open_sections.clear()


def _background_context() -> zmq.Context:
    """A context whose I/O thread runs under SCHED_BATCH: each step's first send wakes it, and
    on a busy core a normal-priority wake-up preempted the training thread (20-200 us a step,
    measured with Lightning on 2 cores; half that under SCHED_BATCH). Set before the first
    socket starts the thread; a platform without the policy keeps the default."""
    ctx = zmq.Context()
    with contextlib.suppress(AttributeError, zmq.ZMQError):
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        ctx.set(zmq.THREAD_PRIORITY, 0)
    return ctx


def _prefix(message: wire.Heartbeat | wire.SectionEnd) -> bytes:
    """The frame of `message` (iteration 0) without its last field: a frame for any iteration
    is this prefix plus the packed iteration (the iteration is the last field)."""
    frame = wire.encode(message)
    zero = _pack_int(0)
    assert frame.endswith(zero)
    return frame[: -len(zero)]


def _packed_iteration(iteration: object) -> bytes:
    """The msgpack bytes of a valid iteration (a non-negative integer, numpy or torch ones too)."""
    if type(iteration) is not int:
        try:
            if isinstance(iteration, bool):
                raise TypeError
            iteration = operator.index(iteration)  # type: ignore[arg-type]
        except TypeError:
            raise RankMonitorClientError(
                f"iteration must be an integer, not {type(iteration).__name__}"
            ) from None
    if not 0 <= iteration <= wire.MAX_ITERATION:
        raise RankMonitorClientError(f"iteration must be in [0, {wire.MAX_ITERATION}]")
    return _pack_int(iteration)


def _env() -> tuple[str, Path, signal.Signals, int]:
    values = {}
    for name in (Env.MONITOR_ADDR, Env.JOB_DIR, ENV_RANK):
        value = os.environ.get(name)
        if not value:
            raise RankMonitorClientError(f"{name} is not set: run this worker under ft_launcher")
        values[name] = value
    try:
        rank = int(values[ENV_RANK])
        stack_signal = signal.Signals(int(os.environ.get(Env.STACK_SIGNAL, signal.SIGUSR2)))
    except ValueError as exc:
        raise RankMonitorClientError(f"bad monitor environment: {exc}") from None
    return values[Env.MONITOR_ADDR], Path(values[Env.JOB_DIR]), stack_signal, rank
