"""Prestarted workers: one per local rank, forked and holding its CUDA context before a restart.

A restarted GPU worker's first second goes to making its CUDA context (1.1 s on one GPU of an
H200 host, 1.3 s with four made at once: `bench/restart/cuda_standby_probe.py`), before the
script has done anything of its own. So while a cycle trains, the fork server forks, for each
local rank, the worker of the next cycle: it settles in the environment this cycle's worker got,
makes its context on that rank's GPU (`child.make_cuda_context`) and waits on its start gate.
When the agent starts that local rank again (an in-job restart, or the in-process tier's
replacement of a dead rank), the held worker gets the "go" with the new cycle's environment and
runs the script at once; otherwise a worker is forked as before.

A held worker runs only where the new environment differs from the one it was made with in
nothing but the variables that change from cycle to cycle (`worker_env.PER_CYCLE`): anything
read before the script (CUDA's and the allocator's variables, the binding, the thread pools)
is then what a fresh worker would have read. Any other difference discards it.

What it costs while training: per GPU one more process holding a CUDA context (about 0.5 GiB of
that GPU's memory, and some host memory); `--ft-prestart-workers=off` turns it off. It is made
`PRESTART_DELAY` after a cycle's workers started, so that its context is not made while theirs
are (the first cycle's also waits for the fork server's deep imports, which the held workers
then have).

A job whose workers call `torch.compile` (`marks.compiles_seen`, watched every WATCH_PERIOD
until seen) has its held workers import inductor's compiler while they wait
(`PRELOAD_ON_COMPILE`): 1.7 s of a compiled model's restart on an H200 host
(`bench/restart/compile_restart_probe.py`), that a non-compiling job does not pay in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping

from ftrun.agent.prewarm import wire as proto
from ftrun.agent.prewarm.forked import ForkedWorker
from ftrun.agent.prewarm.marks import compiles_seen
from ftrun.agent.prewarm.start_env import differing
from ftrun.agent.termination import kill_group_now
from ftrun.agent.worker_env import PER_CYCLE

log = logging.getLogger("ftrun.agent")

PRESTART_DELAY = 3.0
"""Seconds after a cycle's workers started before their successors are prestarted."""
WATCH_PERIOD = 1.0
"""Seconds between looks for a job's first `torch.compile`, until seen."""
PRELOAD_ON_COMPILE = (
    "torch._inductor.compile_fx",
    "torch._functorch.aot_autograd",
    "torch._inductor.codecache",
    "torch._inductor.runtime.triton_heuristics",
)
"""What a compiled model's new process imports before it compiles (3 s on an H200 host)."""


@dataclasses.dataclass
class HeldWorker:
    """A prestarted worker waiting on its start gate."""

    worker: ForkedWorker
    gate_fd: int
    env: Mapping[str, str]
    """The environment it settled in (the cycle's before: `LOCAL_RANK` says which rank)."""
    preloaded: bool = dataclasses.field(default=False, init=False)
    """A "preload" frame was written to its gate."""
    _gate_open: bool = dataclasses.field(default=True, init=False, repr=False)
    _gate_lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False
    )
    """The gate fd is written, and closed, under it."""

    def fits(self, env: Mapping[str, str]) -> str | None:
        """Why this worker cannot run with `env`; None if it can."""
        if self.worker.poll() is not None:
            return f"it exited ({self.worker.returncode})"
        differ = differing(self.env, env, ("",), skip=PER_CYCLE)  # every variable but those
        return f"the environment differs in {differ[:5]}" if differ else None

    def preload(self, modules: tuple[str, ...]) -> None:
        """Have it import `modules` while it waits (once; not after its go)."""
        with self._gate_lock:
            if not self._gate_open or self.preloaded:
                return
            with contextlib.suppress(OSError):  # it died: its exit says so
                os.write(self.gate_fd, proto.encode("preload", modules=list(modules)))
            self.preloaded = True  # after the write: whoever sees it finds the frame there

    def release(self, env: Mapping[str, str]) -> None:
        """Let it run the script with `env`."""
        with self._gate_lock:
            try:
                os.write(self.gate_fd, proto.encode("go", env=dict(env)))
            except OSError:
                pass  # it died meanwhile: its exit says so, as a forked worker's would
            finally:
                self._close_gate()

    def discard(self) -> None:
        with self._gate_lock:
            self._close_gate()  # the child reads EOF and leaves, should the kill miss it
        kill_group_now(self.worker.pid)
        with contextlib.suppress(OSError, ValueError):
            self.worker.stdout.close()
            self.worker.stderr.close()

    def _close_gate(self) -> None:
        if self._gate_open:
            self._gate_open = False
            proto.close_fds(self.gate_fd)


class PrestartPool:
    """The held workers of one node, one per local rank, kept filled between restarts.

    `fork(env, cuda_device)` forks one (the fork server's `prestart`); `remember` records the
    environment each local rank's worker got; `refill_later` prestarts, after PRESTART_DELAY
    and in a thread of its own, a worker for every remembered rank that holds none, then
    watches for the job's first `torch.compile` (`compiles(env)`); `take` hands one over for a
    start.
    """

    def __init__(
        self,
        fork: Callable[[Mapping[str, str], int], HeldWorker],
        delay: float = PRESTART_DELAY,
        compiles: Callable[[Mapping[str, str]], bool] = compiles_seen,
        watch_period: float = WATCH_PERIOD,
    ) -> None:
        self._fork = fork
        self._delay = delay
        self._compiles = compiles
        self._watch_period = watch_period
        self._compiling = False  # a worker of the job called torch.compile
        self._lock = threading.Lock()
        self._held: dict[str, HeldWorker] = {}  # by LOCAL_RANK
        self._wanted: dict[str, Mapping[str, str]] = {}  # by LOCAL_RANK: the last env
        self._generation = 0
        self._closed = threading.Event()

    def remember(self, env: Mapping[str, str]) -> None:
        with self._lock:
            self._wanted[env.get("LOCAL_RANK", "0")] = dict(env)

    def take(self, env: Mapping[str, str]) -> HeldWorker | None:
        """The held worker for `env`'s local rank if it can run with `env` (else discarded)."""
        with self._lock:
            held = self._held.pop(env.get("LOCAL_RANK", "0"), None)
        if held is None:
            return None
        why = held.fits(env)
        if why is not None:
            log.info("prestarted worker (pid %d) not used: %s", held.worker.pid, why)
            held.discard()
            return None
        return held

    def refill_later(self) -> None:
        """Prestart what is missing, PRESTART_DELAY from now (a refill still waiting is
        superseded)."""
        with self._lock:
            self._generation += 1
            generation = self._generation
        threading.Thread(
            target=self._refill, args=(generation,), name="prestart", daemon=True
        ).start()

    def pids(self) -> frozenset[int]:
        with self._lock:
            return frozenset(h.worker.pid for h in self._held.values())

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for worker in held:
            worker.discard()

    def _refill(self, generation: int) -> None:
        if self._closed.wait(self._delay):
            return
        with self._lock:
            wanted = dict(self._wanted)
        for local_rank, env in sorted(wanted.items()):
            with self._lock:
                if generation != self._generation or local_rank in self._held:
                    continue
            try:
                held = self._fork(env, _cuda_device(env))
            except Exception as exc:  # the cycle's own forks say what is wrong, if anything
                log.info("prestarting local rank %s: %s", local_rank, exc)
                return
            with self._lock:
                keep = not self._closed.is_set() and local_rank not in self._held
                if keep:
                    self._held[local_rank] = held
            if not keep:
                held.discard()
            elif self._compiling:
                held.preload(PRELOAD_ON_COMPILE)
        self._watch_compiles(generation)

    def _watch_compiles(self, generation: int) -> None:
        """Until the job is seen compiling (then every held worker preloads inductor's
        compiler), the pool closes, or a newer refill takes over the watch."""
        while not self._compiling:
            with self._lock:
                if generation != self._generation:
                    return
                env = next(iter(self._wanted.values()), None)
            if env is not None and self._compiles(env):
                with self._lock:
                    self._compiling = True
                    held = list(self._held.values())
                log.info("the job compiles: its prestarted workers import inductor's compiler")
                for worker in held:
                    worker.preload(PRELOAD_ON_COMPILE)
                return
            if self._closed.wait(self._watch_period):
                return


def _cuda_device(env: Mapping[str, str]) -> int:
    """The GPU a worker uses by convention: `cuda:LOCAL_RANK` of those it sees."""
    try:
        return max(0, int(env.get("LOCAL_RANK", "0")))
    except ValueError:
        return 0
