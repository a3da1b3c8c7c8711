"""`Wrapper` and `CallWrapper`: NVRx's in-process restart, without its monitor process.

A fault in any rank ends the current restart iteration for every rank (see `iteration`): each
rank aborts its process groups, finalizes, runs its health checks, meets the others at the
iteration's barrier and calls the wrapped function again with the next iteration number, in
the same process: CUDA context, compiled graphs and everything built outside the function
survive. What cannot be recovered this way leaves the wrapper as an exception (the process then
ends, and the launcher restarts the job's workers: the next rung of the ladder):

- an abort that does not finish within its bound (an NCCL abort can hang),
- a failed health check (this rank leaves; the others go on without it),
- a barrier that not every rank reaches within `barrier_timeout`,
- a spent restart budget (`inprocess_protocol.RestartBudget`: under `ft_launcher` the launch
  config's; alone, only the same fault ending iterations in a row): restarting again would
  fail again.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ftrun.aside import Aside
from ftrun.inprocess import events
from ftrun.inprocess import store as stores
from ftrun.inprocess.abort import Abort, AbortTorchDistributed, pin_gloo_groups
from ftrun.inprocess.exception import HealthCheckError
from ftrun.inprocess.exception import TimeoutError as RestartTimeoutError
from ftrun.inprocess.groups import fresh_group_names, release
from ftrun.inprocess.interrupt import Interrupter, RankShouldRestart
from ftrun.inprocess.options import WrapperOptions, build_options
from ftrun.inprocess.params import check_call_wrapper_parameters, substitute_call_wrapper
from ftrun.inprocess.progress import ProgressWatchdog
from ftrun.inprocess.rank_assignment import RankAssignmentCtx
from ftrun.inprocess.sockets import FunctionSockets
from ftrun.inprocess.state import Mode, State
from ftrun.inprocess.watcher import Watcher
from ftrun.inprocess_protocol import (
    Interruption,
    Iteration,
    RestartBudget,
    cause_text,
    forget_iteration,
    newest_iteration,
    root_cause,
)

log = logging.getLogger("ftrun.inprocess")


class Wrapper:
    """Restarts the decorated function in-process, on every rank at once, after a fault.

    Takes every keyword argument of NVRx 0.7's `inprocess.Wrapper` (see
    `ftrun.inprocess.options`: each is honoured, or warned about in one line where ftrun does
    it differently)."""

    def __init__(self, **kwargs: Any) -> None:
        self.options: WrapperOptions = build_options(kwargs)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.options.enabled:
            return fn
        check_call_wrapper_parameters(fn)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with CallWrapper(self) as call_wrapper:
                return call_wrapper(fn, args, kwargs)

        return wrapped


class CallWrapper:
    """One call of a wrapped function: its restart state, passed to the function as any
    argument annotated `CallWrapper` (NVRx's `iteration`, `atomic()`, `ping()`)."""

    def __init__(self, wrapper: Wrapper) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("in-process restart: the wrapped function must create the default "
                               "process group itself (it is initialized already)")  # fmt: skip
        self.options = opts = wrapper.options
        self.state = State.from_env()
        environ = dict(os.environ)
        self.store, self._connect, address = stores.connect(opts.store_factory,
                                                            opts.store_kwargs, environ)  # fmt: skip
        self.state.iteration = newest_iteration(self.store)  # a replacement joins the newest
        self._interrupter = Interrupter()
        self._ranks: dict[int, int | None] = {}
        """This process's rank in each iteration whose keys are not forgotten yet."""
        self._watcher = Watcher(self._interrupter, self._abort, self._forget_old_keys)
        self._watcher_store = self._connect()
        self._timeout_store = self._connect()  # opened now: see `sockets`
        self._sockets = FunctionSockets()
        self._sockets.mark()  # a replacement process aborts before it ever calls the function
        self.progress = ProgressWatchdog(opts, self._on_progress_timeout)
        self._iteration: Iteration | None = None
        self._events = events.AgentReports.for_rank(self.state.rank, environ)
        self._clock = events.PhaseClock()
        self._events.wrapped(address, stores.prefix(environ))
        self._budget = RestartBudget.from_env(environ) or _ALONE
        self._restarts: list[float] = []  # when each restart of this call was made
        self._causes: list[str] = []  # what ended each iteration, oldest first
        # What exists before the first call (imports, a model built outside the function) stays:
        # frozen, a restart's collection scans only what the function allocated (about 0.1-0.3 s
        # less per restart with torch loaded).
        gc.freeze()

    @property
    def iteration(self) -> int:
        """The current restart iteration (0 for the first call)."""
        return self.state.iteration

    def ping(self) -> None:
        """This rank makes progress (`soft_timeout`/`hard_timeout` count from the last ping)."""
        self.progress.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block no restart interrupts (a checkpoint write), and none starts once one has."""
        with self._interrupter.lock:
            yield

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """A block where the progress timeouts do not apply (a long data load)."""
        with self.progress.paused():
            yield

    def __enter__(self) -> CallWrapper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.unfreeze()
        self.progress.close()
        self._watcher.close()
        self._interrupter.close()
        self._events.close()

    def __call__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._assign(set(), "start")
        while True:
            it = Iteration(self.store, self.state.iteration, self.state.world_size)
            done, result = self._attempt(it, fn, args, kwargs)
            if done:
                if self.options.completion is not None:
                    self.options.completion(self.state.freeze())
                return result
            self._next_iteration(it)

    def _attempt(self, it: Iteration, fn: Callable[..., Any], args: tuple,
                 kwargs: dict) -> tuple[bool, Any]:  # fmt: skip
        """Run iteration `it`: (True, result) when every rank completed, else (False, None)
        once this rank is ready to restart."""
        it.enter()
        self._clock.mark("enter")
        self._iteration = it
        self._ranks[it.number] = self.state.rank
        self._watcher.follow(Iteration(self._watcher_store, it.number, it.world_size))
        self.progress.start_iteration()
        fault: Exception | None = None
        stopped: BaseException | None = None
        try:
            result = self._run(it, fn, args, kwargs)
            if result is not _INTERRUPTED:
                return True, result
        except RankShouldRestart as interrupted:  # another rank's fault, or an agent's verdict
            stopped = interrupted
        except Exception as error:  # the function's failure: every rank restarts
            fault = stopped = error
        except BaseException as error:  # KeyboardInterrupt, RestartAbort: this rank leaves
            self._leave(it, error)
            raise
        finally:
            self.progress.stop_iteration()
        self._interrupter.disarm()
        self._clock.start()
        watched = self._watcher.timings
        if watched:  # another rank's fault: this rank's watcher aborted, then signalled
            self._clock.record("watcher_abort", watched["abort_s"])
            self._clock.record("unwind", time.monotonic() - watched["signalled"])
        if fault is not None:
            log.warning("rank %s: restart iteration %d failed: %s", self.state.rank, it.number,
                        _describe(fault))  # fmt: skip
            it.interrupt(Interruption(self.state.rank, "EXCEPTION", _describe(fault), time.time()))
        self._abort()
        self._clock.mark("abort")
        release(stopped, self.options.abort_timeout.total_seconds())
        self._clock.mark("release")
        self._recover(it, fault)
        return False, None

    def _run(self, it: Iteration, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        opts, frozen = self.options, self.state.freeze()
        self._interrupter.arm()
        if it.was_interrupted():  # before this rank armed: its watcher let it pass
            raise RankShouldRestart("the iteration ended before this rank started it")
        if opts.initialize is not None:
            opts.initialize(frozen)
        if opts.health_check is not None:
            try:
                opts.health_check(frozen)
            except Exception as error:
                raise HealthCheckError(str(error)) from error
        self._clock.mark("health_check")
        elapsed = self._clock.elapsed
        phases = self._clock.take()
        if phases is not None:
            self._events.entered(it.number, phases, elapsed)
        result = None
        if self.state.mode == Mode.ACTIVE:
            fresh_group_names(it.number)
            call_args, call_kwargs = substitute_call_wrapper(fn, args, kwargs, self)
            self._sockets.mark()
            with self._interrupter.user_code():
                result = fn(*call_args, **call_kwargs)
        if self._interrupter.disarm():
            raise RankShouldRestart("interrupted as the function returned")
        it.complete()
        if not it.wait_end(opts.completion_timeout):
            raise RestartTimeoutError(f"not every rank completed within {opts.completion_timeout}")
        return _INTERRUPTED if it.was_interrupted() else result

    def _recover(self, it: Iteration, fault: Exception | None) -> None:
        """Finalize, check health and wait for every rank at the iteration's barrier."""
        started = time.monotonic()
        self.state.fn_exception = fault
        frozen = self.state.freeze()
        try:
            if self.options.finalize is not None:
                self.options.finalize(frozen)
            if self.options.restart_health_check is not None:
                self.options.restart_health_check(frozen)
        except Exception as error:
            it.arrive(self.state.rank, leaving=True)
            self._events.left(it.number, _describe(error))
            raise HealthCheckError(f"rank {self.state.rank} leaves: {error}") from error
        self._clock.mark("finalize")
        it.arrive(self.state.rank)
        if not it.wait_go(self.options.barrier_timeout):
            raise RestartTimeoutError(f"not every rank reached restart iteration {it.number}'s "
                                      f"barrier within {self.options.barrier_timeout}")  # fmt: skip
        self._clock.mark("barrier")
        causes = it.interruptions()
        self._within_budget(it, root_cause(causes))
        self._events.recovered(it.number, causes, time.monotonic() - started)
        seen = self._watcher.timings.get("seen")
        if seen is not None and causes:  # from the first fault's record to the watcher seeing it
            self._clock.record("detect", seen - min(c.at for c in causes))

    def _within_budget(self, it: Iteration, cause: Interruption | None) -> None:
        """Go on to the next iteration only if the budget allows another restart; else leave
        the wrapper (every rank decides alike: they read the same causes): the process ends
        with 1, and the launcher takes the next rung, the in-job restart."""
        self._causes.append(cause_text(cause))
        now = time.monotonic()
        why = self._budget.exceeded(self._restarts, self._causes, now)
        if why is None:
            self._restarts.append(now)
            return
        self._events.gave_up(it.number, why)
        if cause is None or cause.rank in (None, self.state.rank) or self.state.rank == 0:
            log.critical("in-process restart gives up: %s; the launcher restarts the workers",
                         why)  # fmt: skip
        raise SystemExit(1)

    def _next_iteration(self, it: Iteration) -> None:
        terminated = it.terminated(range(it.world_size))
        self._assign(terminated, str(it.number))
        self.state.advance()
        self._clock.mark("assignment")

    def _assign(self, terminated: set[int], phase: str) -> None:
        """Rank assignment, at the first call (`phase` "start") or at the end of an iteration
        (its number): each has its own keys, for the assignments that gather through them."""
        ctx_store = stores.PrefixStore(f"ra/{phase}", self.store)
        ctx = self.options.rank_assignment(RankAssignmentCtx(self.state, ctx_store, terminated))
        self.state = ctx.state
        self.state.set_distributed_vars()

    def _forget_old_keys(self, entered: int) -> None:
        """On the watcher thread, as this rank runs iteration `entered`: every rank is past
        `entered - 2`, whose keys go (`iteration.forget_iteration`)."""
        number = entered - 2
        if number in self._ranks:
            forget_iteration(self._watcher_store, number, self._ranks.pop(number))

    def _abort(self) -> None:
        """Abort the process groups, once per iteration (the watcher may have done it), and
        again for a default group made after the watcher's abort: the function was still in
        `init_process_group` when the iteration ended, and its next call would otherwise fail
        with "trying to initialize the default process group twice"."""
        import torch.distributed as dist

        if self._watcher.aborted.is_set():
            if self._watcher.abort_error is not None:
                _give_up(f"aborting the process groups failed: {self._watcher.abort_error}")
            if not dist.is_initialized():
                return
        self._watcher.aborted.set()
        abort: Abort | None = self.options.abort
        bound = self.options.abort_timeout.total_seconds()
        if isinstance(abort, AbortTorchDistributed):
            abort.timeout = bound
        gloo = pin_gloo_groups()  # before the abort destroys the groups
        if abort is not None:
            _bounded(lambda: abort(self.state.freeze()), bound, "the abort")
        if gloo:  # a gloo collective blocked on a peer returns now (see `sockets`)
            self._sockets.shut_down_new()

    def _on_progress_timeout(self, kind: str, why: str) -> None:
        if (it := self._iteration) is not None:
            it_store = Iteration(self._timeout_store, it.number, it.world_size)
            it_store.interrupt(Interruption(self.state.rank, kind, why, time.time()))

    def _leave(self, it: Iteration, error: BaseException) -> None:
        self._interrupter.disarm()
        it.interrupt(Interruption(self.state.rank, "BASE_EXCEPTION", _describe(error),
                                  time.time()))  # fmt: skip
        it.arrive(self.state.rank, leaving=True)
        self._events.left(it.number, _describe(error))
        if self.options.terminate is not None:
            self.options.terminate(self.state.freeze())


_INTERRUPTED = object()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def _bounded(step: Callable[[], object], bound_s: float, what: str) -> None:
    """Run `step` within `bound_s` (on a daemon thread: a user's abort, or an NCCL abort, can
    hang); give up on in-process restart if it does not return in time or times out."""
    call = Aside(step, "ftrun-inprocess-abort")
    if not call.done(bound_s):
        _give_up(f"{what} did not finish within {bound_s:g}s")
    try:
        call.result()
    except RestartTimeoutError as error:
        _give_up(f"{what} did not finish: {error}")
    except BaseException as error:
        log.warning("in-process restart: %s failed: %s", what, _describe(error))


_ALONE = RestartBudget(max_restarts=0, same_in_a_row=3)
"""Without a launcher's budget: NVRx's unbounded restarts, except a fault that ends three
iterations in a row the same way (a function that fails on entry would loop forever)."""


def _give_up(why: str) -> None:
    """In-process restart cannot work here: end the process at once (its threads may be stuck
    in a driver call that would hang a normal exit), so that the launcher restarts it."""
    log.critical("in-process restart gives up: %s; the launcher restarts this rank's job", why)
    logging.shutdown()
    os._exit(1)
