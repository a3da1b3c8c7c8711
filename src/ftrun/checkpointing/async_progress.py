"""The machinery under `async_calls`: a call's lifecycle, the threads, the ranks' agreement.

A `Call` moves through `CallState`; `_ALLOWED` is the one transition table (an illegal move
raises): SCHEDULED -> RUNNING -> DONE or FAILED; DONE -> FINALIZED; SCHEDULED -> DONE for a no-op
request (`async_fn=None`) and -> FAILED for a `preload_fn` that raised; every state but FINALIZED
-> ABORTED, which is final: a result that arrives for an aborted call is dropped, so it can never
be finalized. Every move happens under the queue's one `threading.Condition` and notifies it,
which is what a blocking wait sleeps on (no polling).

Workers: `PersistentWorker` is one daemon thread taking calls in order from a queue (NVRx's
`PersistentAsyncCaller`, without the process); `ThreadPerCallWorker` starts a daemon thread per
call (NVRx's `TemporalAsyncCaller`, without the fork), so its calls may overlap.

Agreement: `Progress` is what one rank says (five ints, reduced by MIN in one all_reduce) and
`decide` the pure function every rank applies to the reduced numbers.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ftrun.checkpointing.errors import CheckpointUsageError

logger = logging.getLogger(__name__)

THREAD_NAME = "ftrun-async-calls"
NONE = 2**62  # "no such call" in a `Progress` field: larger than any index, so MIN ignores it


class CallState(str, enum.Enum):
    """Where one async call is; `_ALLOWED` is the only place the moves are defined."""

    SCHEDULED = "scheduled"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    FINALIZED = "finalized"
    ABORTED = "aborted"


_ALLOWED: dict[CallState, frozenset[CallState]] = {
    CallState.SCHEDULED: frozenset(
        {CallState.RUNNING, CallState.DONE, CallState.FAILED, CallState.ABORTED}
    ),
    CallState.RUNNING: frozenset({CallState.DONE, CallState.FAILED, CallState.ABORTED}),
    CallState.DONE: frozenset({CallState.FINALIZED, CallState.ABORTED}),
    CallState.FAILED: frozenset({CallState.ABORTED}),
    CallState.FINALIZED: frozenset(),
    CallState.ABORTED: frozenset(),
}
SETTLED = frozenset({CallState.DONE, CallState.FAILED, CallState.FINALIZED, CallState.ABORTED})


class Call:
    """One scheduled request: what the worker runs, what the trainer finalizes, and its state."""

    def __init__(
        self, idx: int, finalize_fns: Sequence[Callable[[], Any]], cond: threading.Condition
    ) -> None:
        self.idx = idx
        self.finalize_fns = tuple(finalize_fns)
        self.error: BaseException | None = None
        self._state = CallState.SCHEDULED
        self._cond = cond
        self._work: tuple[Callable[..., Any], Sequence[Any], Mapping[str, Any]] | None = None

    @property
    def state(self) -> CallState:
        return self._state

    def set_work(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        self._work = (fn, args, kwargs)

    def move(self, to: CallState, error: BaseException | None = None) -> None:
        with self._cond:
            if to not in _ALLOWED[self._state]:
                raise RuntimeError(f"async call {self.idx}: illegal move {self._state} -> {to}")
            self._state = to
            if error is not None:
                self.error = error
            self._cond.notify_all()

    def run(self) -> None:
        """Run the work in this (worker) thread; whatever it raises is kept, never propagated."""
        with self._cond:
            if self._state is CallState.ABORTED:
                self._work = None
                return
            self.move(CallState.RUNNING)
        work, self._work = self._work, None  # drop our reference to the args once taken
        assert work is not None
        fn, args, kwargs = work
        del work
        error: BaseException | None = None
        try:
            fn(*args, **kwargs)
        except BaseException as e:
            # Keep the traceback's lines but not its frames' locals (the staged state, often GiBs).
            traceback.clear_frames(e.__traceback__)
            error = e
        del fn, args, kwargs  # free the staged state now, not when the call is finalized
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        with self._cond:
            if self._state is CallState.ABORTED:
                logger.debug("async call %s ended after it was aborted: result dropped", self.idx)
                return
            if error is None:
                self.move(CallState.DONE)
            else:
                logger.debug("async call %s raised %r", self.idx, error)
                self.move(CallState.FAILED, error)

    def fail_unsettled(self, error: BaseException) -> None:
        with self._cond:
            if self._state in (CallState.SCHEDULED, CallState.RUNNING):
                self.move(CallState.FAILED, error)


class PersistentWorker:
    """One daemon thread, started on the first call, running calls in the order submitted."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, call: Call) -> None:
        if self._thread is None:
            # Daemon: a stuck write must never keep the interpreter from exiting; an unfinalized
            # call is invisible anyway (the finalize is what publishes it).
            self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
            self._thread.start()
        self._inbox.put(call)

    def stop(self, wait_s: float) -> bool:
        """Ask the thread to exit after the calls before; True if it has within `wait_s`."""
        if self._thread is None:
            return True
        self._inbox.put(None)
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        current: Call | None = None
        try:
            while (current := self._inbox.get()) is not None:
                current.run()
        finally:
            # Only reached with calls left if `run` itself broke: fail them, never leave them
            # waiting on a thread that is gone.
            gone = RuntimeError("the async calls worker thread exited")
            if current is not None:
                current.fail_unsettled(gone)
            while not self._inbox.empty():  # this thread is its only reader
                if (left := self._inbox.get_nowait()) is not None:
                    left.fail_unsettled(gone)


class ThreadPerCallWorker:
    """A daemon thread per call (`persistent=False`); calls may run at the same time."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def submit(self, call: Call) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=call.run, name=f"{THREAD_NAME}-{call.idx}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


@dataclasses.dataclass(frozen=True)
class Progress:
    """One rank's async calls as five ints, reduced by MIN over the ranks (`NONE`: no call)."""

    done_through: int  # the last call of the leading run of calls done here
    first_failed: int  # the first call that failed here
    first_timed_out: int  # the first call still running when a blocking wait gave up here
    last_scheduled: int  # MIN over ranks of the last index scheduled ...
    neg_last_scheduled: int  # ... and -MAX: ranks that scheduled different numbers of calls

    def agreed(self) -> Progress:
        return Progress(*agree_min(dataclasses.astuple(self)))


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every rank does: finalize up to `finalize_through`, then raise for one of these."""

    finalize_through: int
    failed: int | None = None
    timed_out: int | None = None
    mismatch: tuple[int, int] | None = None


def decide(agreed: Progress) -> Decision:
    """The choice from the agreed progress; pure, so every rank makes the same one."""
    low, high = agreed.last_scheduled, -agreed.neg_last_scheduled
    if low != high:
        return Decision(finalize_through=-1, mismatch=(low, high))
    head = agreed.done_through + 1  # the first call not done on every rank
    if agreed.first_failed == head:
        return Decision(agreed.done_through, failed=head)
    if agreed.first_timed_out != NONE:
        return Decision(agreed.done_through, timed_out=agreed.first_timed_out)
    return Decision(agreed.done_through)


def agree_min(values: tuple[int, ...] | list[int]) -> list[int]:
    """The element-wise MIN over all ranks (one all_reduce); `values` if not distributed."""
    if not distributed():
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return [int(v) for v in tensor.tolist()]


def collective_device() -> torch.device:
    """Where the default group's collectives take tensors: an NCCL-only group, CUDA ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def staged_args(request: Any) -> tuple[Any, ...]:
    """`async_fn_args`, with `preload_fn()`'s result in place of item 1 when there is one."""
    args = tuple(request.async_fn_args)
    if request.preload_fn is None:
        return args
    if len(args) < 2:
        raise CheckpointUsageError(
            f"preload_fn's result replaces async_fn_args[1], but there are {len(args)} args"
        )
    return (args[0], request.preload_fn(), *args[2:])


def failed_message(idx: int, cause: BaseException | None) -> str:
    if cause is None:
        return f"async call {idx} failed on another rank"
    text = str(cause).strip().splitlines()
    return f"async call {idx} failed: {type(cause).__name__}: {text[0] if text else ''}"


def log_prefix() -> str:
    return f"rank {dist.get_rank()}: " if distributed() else ""
