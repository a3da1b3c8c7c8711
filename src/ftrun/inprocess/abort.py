"""The `abort` hook (NVRx's `inprocess.abort`): unblock the training thread after a fault.

The wrapper's monitor thread calls it while the training thread may be stuck in a collective
with a dead peer; aborting the communicators makes that collective fail, so the training thread
can unwind. Every step here is bounded: an abort that hangs would hang the restart it exists for.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ftrun.aside import Aside
from ftrun.environment import Env
from ftrun.inprocess import exception
from ftrun.inprocess.nccl_wake import ProxyWaker
from ftrun.inprocess.state import FrozenState, Hook

log = logging.getLogger("ftrun.inprocess")

DEFAULT_ABORT_TIMEOUT_S = 30.0
_FR_BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FR_SHARE = 1 / 3
"""The share of the abort timeout the Flight Recorder dump may take (diagnostics come second)."""


class Abort(Hook):
    """Runs in the wrapper's monitor thread when a fault is detected, to unblock the training
    thread (e.g. one waiting in a collective on a dead rank); compose several with `Compose`."""


class AbortTorchDistributed(Abort):
    """Aborts every backend of every process group (NCCL, gloo, ...), each in its own daemon
    thread so that one hung communicator does not hold up the others, then destroys the process
    groups. Dumps the Flight Recorder trace first when `torch_fr_trace_path` (or FTRUN_/
    NVRX_FR_TRACE_PATH) is set and the recorder is on (TORCH_FR_BUFFER_SIZE or
    TORCH_NCCL_TRACE_BUFFER_SIZE > 0), to `<path>/iter_<iteration>/_dump_<rank>.json`.

    ftrun: bounded by `timeout` seconds (`exception.TimeoutError` past it, which the wrapper
    escalates; NVRx waits forever). A gloo backend is not aborted: torch 2.13's
    `ProcessGroupGloo.abort()` does not return a blocked collective and leaves its threads
    joinable, so the process aborts ("terminate called without an active exception") when the
    group is freed at exit. The wrapper stops gloo collectives by shutting down the sockets the
    function opened (`ftrun.inprocess.sockets`). `wake_nccl` (ftrun): wake NCCL's proxy threads
    while the aborts run (`ftrun.inprocess.nccl_wake`; each would otherwise sleep up to 0.5 s
    before it sees the abort); `wake_nccl=False` leaves them to their own polls.
    """

    def __init__(
        self, torch_fr_trace_path: str | None = None, *, timeout: float = DEFAULT_ABORT_TIMEOUT_S,
        wake_nccl: bool = True,
    ) -> None:  # fmt: skip
        ours, nvrx = os.environ.get(Env.FR_TRACE_PATH), os.environ.get("NVRX_FR_TRACE_PATH")
        self.torch_fr_trace_path = torch_fr_trace_path or ours or nvrx or None
        self.timeout = timeout
        self.wake_nccl = wake_nccl

    def __call__(self, state: FrozenState) -> FrozenState:
        if not (dist.is_available() and dist.is_initialized()):
            return state
        deadline = time.monotonic() + self.timeout
        if self.torch_fr_trace_path and _flight_recorder_on():
            path = os.path.join(self.torch_fr_trace_path, f"iter_{state.iteration}")
            dump = _bounded(
                {"flight recorder dump": lambda: _dump_fr_trace(path)},
                time.monotonic() + self.timeout * _FR_SHARE,
            )
            if dump:
                log.warning("abort: %s; aborting the process groups anyway", dump[0])
        started = time.monotonic()
        # NCCL's proxy threads would each sleep up to 0.5 s before they see the abort.
        with ProxyWaker(enabled=self.wake_nccl) as waker:
            late = _bounded(_backend_aborts(), deadline)
        if late:
            raise exception.TimeoutError(f"abort: {', '.join(late)}")
        aborted = time.monotonic()
        late = _bounded({"destroy_process_group": dist.destroy_process_group}, deadline)
        if late:
            raise exception.TimeoutError(f"abort: {', '.join(late)}")
        log.info("abort: backends %.3fs (%d wake-ups to NCCL), destroy_process_group %.3fs",
                 aborted - started, waker.pokes, time.monotonic() - aborted)  # fmt: skip
        return state


class AbortTransformerEngine(Abort):
    """Frees TransformerEngine's userbuffers and resets its FP8 global state, which holds a
    process group that is now gone. A no-op without transformer_engine."""

    def __call__(self, state: FrozenState) -> FrozenState:
        if importlib.util.find_spec("transformer_engine") is None:
            log.debug("AbortTransformerEngine: transformer_engine is not installed; nothing to do")
            return state
        for what, step in (("userbuffers", _te_destroy_ub), ("FP8 state", _te_reset_fp8)):
            try:
                step()
            except Exception as exc:  # an optional cleanup must not stop the restart
                log.warning("AbortTransformerEngine: resetting %s failed: %r", what, exc)
        return state


class AbortPersistentCheckpointProcesses(Abort):
    """NVRx aborts its persistent async-checkpoint worker process here.

    ftrun: a no-op. ftrun's async checkpointing (`ftrun.checkpointing.async_calls`) runs in a
    daemon thread of the training process, owned by each `AsyncCallsQueue`, not in a global
    persistent process: there is no process to abort and no registry of queues to reach. A call
    left unfinished is never published (its finalize never runs); to drop it at once, close the
    queue with `close(abort=True)` in your own `Finalize`.
    """

    def __call__(self, state: FrozenState) -> FrozenState:
        return state


def _flight_recorder_on() -> bool:
    for name in _FR_BUFFER_ENV:
        value = os.environ.get(name, "0").strip() or "0"
        try:
            if int(value) > 0:
                return True
        except ValueError:
            log.warning("abort: %s=%r is not an integer; taken as 0", name, value)
    return False


def _dump_fr_trace(directory: str) -> None:
    """This rank's Flight Recorder entries as JSON (torch 2.13's `_dump_fr_trace_json`; older
    torch names it `_dump_nccl_trace_json`); skipped where torch has neither."""
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace_json", None)
    dump = dump or getattr(c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        log.info("abort: this torch cannot dump the Flight Recorder; no trace written")
        return
    trace = dump(includeCollectives=True, onlyActive=True)
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, f"_dump_{dist.get_rank()}.json")
    with open(target, "wb") as f:
        f.write(trace if isinstance(trace, bytes) else str(trace).encode())
    log.info("abort: Flight Recorder trace written to %s", target)


def pin_gloo_groups() -> bool:
    """Pin each process group that has a gloo backend for the life of the process; whether
    there was one.

    A gloo group whose collective was cut short (the wrapper shuts its sockets down, see
    `ftrun.inprocess.sockets`) must never be freed: its destructor ends the process with
    SIGABRT ("terminate called without an active exception") whenever the last reference goes,
    DDP's or the interpreter's at exit (a worker forked by ft_launcher ends without that
    teardown; under torchrun it failed 3 of NVRx's 6 CPU example runs). An extra reference
    that nothing releases keeps it; its threads end with the process."""
    pinned: dict[int, Any] = {}
    for group, _, backend in _group_backends():
        if is_gloo(backend) and id(group) not in pinned:
            pinned[id(group)] = group
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    return bool(pinned)


def _group_backends() -> Iterator[tuple[Any, str, Any]]:
    """`(group, "<group>/<device>", backend)` for each backend of each live process group (a
    backend two groups share comes once per group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group, name in list(dist.distributed_c10d._world.pg_names.items()):
        for device in getattr(group, "_device_types", ()):
            try:
                yield group, f"{name}/{device.type}", group._get_backend(device)
            except RuntimeError:
                continue  # no backend for this device type


def is_gloo(backend: Any) -> bool:
    return type(backend).__name__ == "ProcessGroupGloo"  # a build without gloo has no class


def _backend_aborts() -> dict[str, Callable[[], Any]]:
    """`{"<type> <group>/<device>": abort}` for each distinct backend of each process group."""
    found: dict[int, tuple[str, Callable[[], Any]]] = {}
    for _, where, backend in _group_backends():
        if is_gloo(backend):
            continue  # see the class: its abort() returns nothing and breaks its destructor
        stop = getattr(backend, "abort", None) or getattr(backend, "shutdown", None)
        if stop is not None and id(backend) not in found:
            found[id(backend)] = (f"{type(backend).__name__} {where}", stop)
    return dict(found.values())


def _bounded(steps: dict[str, Callable[[], Any]], deadline: float) -> list[str]:
    """Run each step in its own daemon thread; the names of those still running at `deadline`.
    A step that raises is logged, not re-raised: the next step (destroying the groups) must
    still run."""
    calls = {name: Aside(functools.partial(_logged, name, step), f"ftrun-abort {name}")
             for name, step in steps.items()}  # fmt: skip
    return [f"{name} still running at the deadline" for name, call in calls.items()
            if not call.done(max(0.0, deadline - time.monotonic()))]  # fmt: skip


def _logged(name: str, step: Callable[[], Any]) -> None:
    try:
        step()
    except Exception as exc:
        log.warning("abort: %s failed: %r", name, exc)


def _te_destroy_ub() -> None:
    import transformer_engine.pytorch as te

    base = getattr(getattr(te, "module", None), "base", None)
    if base is not None and hasattr(base, "destroy_ub"):
        base.destroy_ub()


def _te_reset_fp8() -> None:
    import transformer_engine.pytorch.fp8 as te_fp8

    manager = getattr(te_fp8, "FP8GlobalStateManager", None)
    if manager is not None:
        manager.reset()
