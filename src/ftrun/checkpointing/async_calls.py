"""NVRx's async calls (`AsyncRequest`, `AsyncCallsQueue`), without its hangs.

Switching from NVRx is an import change. A call runs `async_fn(*async_fn_args,
**async_fn_kwargs)` off the training thread; once it is done on every rank, its `finalize_fns`
run in the trainer, in call order. The finalize is where a checkpoint becomes visible (the
caller's atomic rename), so a call that failed, timed out or was aborted leaves nothing visible.

Where it runs: a daemon thread (one per queue with `persistent=True`, one per call otherwise;
see `async_progress`), not NVRx's spawned or forked process. The work is I/O-bound and file writes
release the GIL; nothing is pickled, no process with CUDA and NCCL threads is forked, and a
failure is an exception object in our own memory. The price: an async fn that is CPU-bound in
Python (pickling many small objects, pure-Python compression) holds the GIL and slows the
training thread; stage in `preload_fn` and keep the fn to writes, or start a process from it.
A thread cannot be killed: a timed-out or aborted fn runs on until it returns, and its result
is dropped.

Staging: `preload_fn` runs in the trainer, inside `schedule_async_request`; its result replaces
`async_fn_args[1]` (NVRx's convention: the state dict). The trainer must not change what the fn
reads until the call is done; a host copy made by `preload_fn` is how. If `preload_fn` raises,
the error propagates at once, unchanged; the call index is still used (so the ranks' indices stay
aligned) and the call is settled as failed, below.

Agreement: every rank calls `schedule_async_request`, `maybe_finalize_async_calls` and `close`
in the same order (as in NVRx). When torch.distributed is initialized and `no_dist` is False,
`maybe_finalize_async_calls` makes ONE all_reduce (MIN) of five int64s on the default group (a
CPU tensor; CUDA if that group is NCCL-only): this rank's `Progress`. Every rank gets the same
numbers, so `decide` makes the same choice everywhere: finalize the calls done on every rank;
if the next call failed on any rank, drop it and raise `AsyncCallError` on every rank (the
original error as `__cause__` where it failed); if any rank timed out, raise
`AsyncCallTimeoutError` on every rank, the call and those after it abandoned (never finalized)
and the worker thread left to them: the next call runs on a new one. A rank whose call failed
or hung thus joins the same collective and never leaves the others waiting in it. Without
torch.distributed (or with `no_dist=True`) the same decision is made from this rank's numbers.
With nothing pending no collective is made (as in NVRx). Calls are settled in order: those
after a failed one go on.

`blocking=True` first waits (on a condition, no polling) until every call has ended on this
rank, at most `timeout` seconds, then agrees as above. Keep `timeout` below the process group's
timeout so that our typed error, not the collective's, is what every rank sees.

A finalize_fn that raises propagates unchanged; its call counts as settled.

`close()` settles every call (collective, like NVRx's), raising the first failure once the rest
are settled, or a timeout at once; then stops the thread. `close(abort=True)` is local and waits
for nothing: unfinished calls become ABORTED and their finalize_fns never run. Either way the
queue is closed: `schedule_async_request` raises, `maybe_finalize_async_calls` returns [].
"""

from __future__ import annotations

import logging
import threading
import types
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ftrun.checkpointing.async_progress import (
    NONE,
    SETTLED,
    Call,
    CallState,
    Decision,
    PersistentWorker,
    Progress,
    ThreadPerCallWorker,
    agree_min,
    decide,
    distributed,
    failed_message,
    log_prefix,
    staged_args,
)
from ftrun.checkpointing.errors import CheckpointError, CheckpointUsageError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
_NO_KWARGS: Mapping[str, Any] = types.MappingProxyType({})


class AsyncCallError(CheckpointError):
    """An async call failed (here: see `__cause__`; or on another rank) and was not finalized."""

    def __init__(
        self, message: str, call_idx: int | None = None, finalized: Sequence[int] = ()
    ) -> None:
        super().__init__(message)
        self.call_idx = call_idx
        self.finalized = list(finalized)  # calls finalized by the same call before this error


class AsyncCallTimeoutError(AsyncCallError):
    """A blocking wait for async calls ran past the queue's `timeout` on some rank."""


class AsyncRequest(NamedTuple):
    """What to run in the background (`async_fn`, its args) and what to run after (NVRx's fields).

    `async_fn=None` is a no-op request. `preload_fn()` runs in the trainer when the request is
    scheduled and its result replaces `async_fn_args[1]`. `is_frozen` and `call_idx` are set by
    the queue, as in NVRx.
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple[Any, ...]
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: Mapping[str, Any] = _NO_KWARGS
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append `fn`, to run after the finalize_fns already there; not once frozen."""
        if self.is_frozen:
            raise CheckpointUsageError("cannot add a finalize_fn to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """A frozen copy, with its own list of finalize_fns (later additions cannot reach it)."""
        return self._replace(is_frozen=True, finalize_fns=list(self.finalize_fns))

    def execute_sync(self) -> None:
        """Run it here and now: preload, `async_fn`, agree, finalize (NVRx's synchronous save).

        Collective when torch.distributed is initialized: one all_reduce where NVRx has a
        barrier, so a rank whose fn raised makes every rank raise instead of waiting in it.
        """
        error: Exception | None = None
        try:
            if self.async_fn is not None:
                self.async_fn(*staged_args(self), **self.async_fn_kwargs)
        except Exception as e:
            error = e
        if agree_min([0 if error else 1])[0] == 0:
            raise AsyncCallError(failed_message(self.call_idx, error), self.call_idx) from error
        self.execute_finalize_fns(validate_matching_call_idx=False)

    def execute_finalize_fns(self, validate_matching_call_idx: bool = True) -> int:
        """Run the finalize_fns, after checking (if asked) that all ranks are at this call."""
        if validate_matching_call_idx:
            low, neg_high = agree_min([self.call_idx, -self.call_idx])
            if low != -neg_high:
                message = f"ranks finalize different async calls ({low}..{-neg_high})"
                raise AsyncCallError(message, self.call_idx)
        for fn in self.finalize_fns:
            fn()
        return self.call_idx


class AsyncCallsQueue:
    """Schedules `AsyncRequest`s and finalizes them in order once done on every rank.

    Not for concurrent use from several trainer threads; the worker side is synchronized.
    """

    def __init__(self, persistent: bool = True, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout > 0:
            raise CheckpointUsageError(f"AsyncCallsQueue timeout must be > 0 s, not {timeout!r}")
        self.persistent = persistent
        self.timeout = float(timeout)
        self.call_idx = -1  # the last index handed out, as in NVRx
        self._cond = threading.Condition(threading.RLock())
        self._calls: deque[Call] = deque()  # not yet settled, in index order
        self._worker = PersistentWorker() if persistent else ThreadPerCallWorker()
        self._closed = False

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start `async_request` in the background; returns its call index. On every rank."""
        if self._closed:
            raise CheckpointUsageError("this AsyncCallsQueue is closed")
        request = _as_request(async_request).freeze()
        self.call_idx += 1
        call = Call(self.call_idx, request.finalize_fns, self._cond)
        self._calls.append(call)
        if request.async_fn is None:
            call.move(CallState.DONE)
            return call.idx
        try:
            args = staged_args(request)
        except BaseException as e:
            call.move(CallState.FAILED, e)
            raise
        call.set_work(request.async_fn, args, request.async_fn_kwargs)
        self._worker.submit(call)
        return call.idx

    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False
    ) -> list[int]:
        """Finalize the calls done on every rank (all of them if `blocking`); their indices.

        Collective unless `no_dist` or nothing is pending. Raises `AsyncCallError` for a call
        that failed on any rank, `AsyncCallTimeoutError` if a blocking wait gave up on any rank.
        """
        if not self._calls:
            return []
        local = self._progress(self._wait_settled() if blocking else None)
        agreed = local if no_dist or not distributed() else local.agreed()
        return self._apply(decide(agreed), local)

    def get_num_unfinalized_calls(self) -> int:
        """The number of scheduled calls not yet settled (finalized or raised)."""
        return len(self._calls)

    @classmethod
    def warmup_persistent_caller(cls, rank: int, *args: Any, **kwargs: Any) -> None:
        """NVRx 0.7's: pre-start its worker process so that the first save does not wait for
        it. Nothing to do here: ftrun's worker is a thread, started with each queue in
        microseconds. NVRx's process settings (priorities, daemon, ...) have no thread
        equivalent: given, a warning says they are not applied."""
        if args or kwargs:
            logger.warning(
                "AsyncCallsQueue.warmup_persistent_caller: %s not applied: ftrun's async "
                "worker is a thread of the training process",
                ", ".join([*(f"argument {i + 2}" for i in range(len(args))), *kwargs]),
            )

    def close(self, abort: bool = False) -> None:
        """Settle every call (collective) and stop the worker; or, with `abort`, drop them."""
        if self._closed:
            return
        self._closed = True
        settled, error = False, None  # settled: every call ended, so the worker joins at once
        try:
            if not abort:
                error = self._settle_all()
                settled = True
        finally:
            self._shutdown(wait_s=self.timeout if settled else 0.0)
        if error is not None:
            raise error

    def _settle_all(self) -> AsyncCallError | None:
        """Finalize or drop every call; the first failure, or raise if no more can settle."""
        first_error: AsyncCallError | None = None
        while self._calls:
            before = len(self._calls)
            try:
                self.maybe_finalize_async_calls(blocking=True)
            except AsyncCallTimeoutError:
                raise
            except AsyncCallError as e:
                if len(self._calls) >= before:  # nothing settled (ranks disagree): stop
                    raise
                first_error = first_error or e
        return first_error

    def _abandon_from(self, idx: int) -> None:
        """Drop call `idx` (past its bound: a hung file system, say) and those after it, never
        finalized, and leave their worker to them: a call that never returns must not hold
        every later save behind it (the calls after it wait on the same thread)."""
        with self._cond:
            for call in [c for c in self._calls if c.idx >= idx]:
                call.move(CallState.ABORTED)
                self._calls.remove(call)
        self._worker.stop(0.0)
        self._worker = type(self._worker)()

    def _shutdown(self, wait_s: float) -> None:
        with self._cond:
            aborted = [call.idx for call in self._calls]
            for call in self._calls:
                call.move(CallState.ABORTED)
            self._calls.clear()
        if aborted:
            logger.warning("%saborted async calls %s: not finalized", log_prefix(), aborted)
        if not self._worker.stop(wait_s):
            logger.warning(
                "%sasync calls worker still busy (an aborted fn?): its result is dropped",
                log_prefix(),
            )

    def _wait_settled(self) -> int | None:
        """Wait until every call has ended here; the first call still running at the timeout."""
        with self._cond:
            self._cond.wait_for(
                lambda: all(c.state in SETTLED for c in self._calls), timeout=self.timeout
            )
            return next((c.idx for c in self._calls if c.state not in SETTLED), None)

    def _progress(self, timed_out: int | None) -> Progress:
        with self._cond:
            done_through = self._calls[0].idx - 1
            for call in self._calls:
                if call.state is not CallState.DONE:
                    break
                done_through = call.idx
            failed = (c.idx for c in self._calls if c.state is CallState.FAILED)
            first_failed = next(failed, NONE)
        timed = NONE if timed_out is None else timed_out
        return Progress(done_through, first_failed, timed, self.call_idx, -self.call_idx)

    def _apply(self, decision: Decision, local: Progress) -> list[int]:
        finalized: list[int] = []
        while self._calls and self._calls[0].idx <= decision.finalize_through:
            call = self._calls.popleft()
            for fn in call.finalize_fns:
                fn()
            call.move(CallState.FINALIZED)
            finalized.append(call.idx)
        if finalized:
            logger.debug("%sfinalized async calls %s", log_prefix(), finalized)
        if decision.failed is not None:
            call = self._calls.popleft()
            cause = call.error if call.state is CallState.FAILED else None
            if call.state is CallState.DONE:  # done here, failed elsewhere: never finalized
                call.move(CallState.ABORTED)
            raise AsyncCallError(failed_message(call.idx, cause), call.idx, finalized) from cause
        if decision.timed_out is not None:
            where = "here" if local.first_timed_out != NONE else "on another rank"
            message = (
                f"async call {decision.timed_out} still running {where} after the "
                f"{self.timeout:g} s timeout: abandoned, the next call runs on a new worker"
            )
            self._abandon_from(decision.timed_out)
            raise AsyncCallTimeoutError(message, decision.timed_out, finalized)
        if decision.mismatch is not None:
            low, high = decision.mismatch
            message = f"ranks scheduled different numbers of async calls (last {low}..{high})"
            raise AsyncCallError(message, None, finalized)
        return finalized


def _as_request(obj: Any) -> AsyncRequest:
    """An `AsyncRequest`; another NamedTuple with its fields (Megatron's, NVRx's) is converted."""
    if not isinstance(obj, AsyncRequest):
        fields = obj._asdict() if hasattr(obj, "_asdict") else None
        if fields is None or not {"async_fn", "async_fn_args", "finalize_fns"} <= fields.keys():
            raise CheckpointUsageError(f"not an AsyncRequest: {type(obj).__name__}")
        obj = AsyncRequest(**{k: v for k, v in fields.items() if k in AsyncRequest._fields})
    if obj.async_fn is not None and not callable(obj.async_fn):
        raise CheckpointUsageError(f"async_fn is not callable: {obj.async_fn!r}")
    if not all(callable(fn) for fn in obj.finalize_fns):
        raise CheckpointUsageError(f"a finalize_fn is not callable: {obj.finalize_fns!r}")
    if obj.preload_fn is not None and len(obj.async_fn_args) < 2:
        raise CheckpointUsageError("preload_fn's result replaces async_fn_args[1]: give 2+ args")
    return obj
