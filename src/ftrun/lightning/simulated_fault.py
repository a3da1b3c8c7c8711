"""A fault injected on purpose at the end of a training step (tests, demos, drills).

`SimulatedFault(kind, rank, step, cycle=0)`: on global rank `rank`, when the step that makes
`trainer.global_step == step` ends, in job cycle `cycle` (`FTRUN_CYCLE`; None: every cycle, which
fails every restart too):

- "exception": raises `SimulatedFaultError` (Lightning's `on_exception` path, exit code 1);
- "kill": SIGKILL to this rank (no Python teardown at all, as a segfault or the OOM killer);
- "hang": sleeps forever inside the "step" section (heartbeats and section timeouts fire).

Also given as a mapping with those keys, or as a string "KIND:RANK:STEP[:CYCLE]";
`parse_all` takes one of those or a list of them (a crash in one cycle, a hang in the next).

`SimulatedFaultParams` is NVRx's timed fault (`simulated_fault_params=`), in every cycle.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

from ftrun.environment import Env
from ftrun.lightning.errors import LightningUsageError, SimulatedFaultError

KINDS = ("exception", "kill", "hang")


@dataclasses.dataclass(frozen=True)
class SimulatedFault:
    """Fire `kind` on `rank` at `step` in `cycle` (None: every cycle)."""

    kind: str
    rank: int
    step: int
    cycle: int | None = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LightningUsageError(f"simulated fault kind must be one of {KINDS}: {self.kind!r}")
        for name in ("rank", "step", "cycle"):
            value = getattr(self, name)
            if value is None and name == "cycle":
                continue
            if type(value) is not int or value < 0:
                raise LightningUsageError(f"simulated fault {name} must be an int >= 0: {value!r}")

    @classmethod
    def parse(cls, spec: SimulatedFault | Mapping[str, Any] | str | None) -> SimulatedFault | None:
        if spec is None or isinstance(spec, SimulatedFault):
            return spec
        if isinstance(spec, Mapping):
            try:
                return cls(**spec)
            except TypeError as exc:
                raise LightningUsageError(f"bad simulated fault {dict(spec)!r}: {exc}") from None
        if isinstance(spec, str):
            kind, *numbers = spec.split(":")
            if len(numbers) not in (2, 3) or not all(n.isdigit() for n in numbers):
                raise LightningUsageError(f"not KIND:RANK:STEP[:CYCLE]: {spec!r}")
            return cls(kind, *(int(n) for n in numbers))
        raise LightningUsageError(f"simulated fault must be a mapping or a string: {spec!r}")

    @classmethod
    def parse_all(cls, spec: Any) -> tuple[SimulatedFault, ...]:
        """One fault spec, or a list/tuple of them; None: no fault."""
        if isinstance(spec, (list, tuple)):
            return tuple(f for f in map(cls.parse, spec) if f is not None)
        fault = cls.parse(spec)
        return () if fault is None else (fault,)

    def due(self, rank: int, step: int, cycle: int) -> bool:
        return (rank, step) == (self.rank, self.step) and self.cycle in (None, cycle)

    def fire(self) -> None:
        print(f"simulated fault: {self.kind} on rank {self.rank} at step {self.step}", flush=True)
        if self.kind == "exception":
            raise SimulatedFaultError(f"simulated fault at step {self.step} on rank {self.rank}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # "hang"
            time.sleep(3600)


def current_cycle() -> int:
    """The job-wide cycle number ft_launcher gives workers (0 outside ft_launcher)."""
    return int(os.environ.get(Env.CYCLE, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


TIMED_KINDS = ("random", "rank_killed", "rank_hung")


@dataclasses.dataclass
class SimulatedFaultParams:
    """NVRx's timed fault: `base_delay + rand_delay * U(0, 1)` seconds after the fit starts,
    rank `rank_to_fail` (None: one picked at random, the same on every rank) is killed
    (SIGKILL, "rank_killed") or stopped (SIGSTOP, "rank_hung"; "random": either)."""

    fault_type: str
    base_delay: float
    rand_delay: float = 0.0
    rank_to_fail: int | None = None

    def __post_init__(self) -> None:
        if self.fault_type not in TIMED_KINDS:
            raise LightningUsageError(
                f"fault_type must be one of {TIMED_KINDS}: {self.fault_type!r}"
            )
        if min(self.base_delay, self.rand_delay) < 0:
            raise LightningUsageError("simulated fault delays must be >= 0")

    @classmethod
    def parse(cls, spec: Any) -> SimulatedFaultParams | None:
        """An instance, anything `SimulatedFaultParams(**spec)` takes, or None (NVRx's rule)."""
        if spec is None or isinstance(spec, cls):
            return spec
        try:
            return cls(**spec)
        except TypeError as exc:
            raise LightningUsageError(f"bad simulated_fault_params {spec!r}: {exc}") from None

    def start(self, rank: int, world_size: int, seed: str) -> threading.Thread | None:
        """On the rank to fail, a daemon thread that fires after the delay; None elsewhere.
        `seed` is the same on every rank of a cycle: the random rank is picked without a
        collective (NVRx broadcasts it)."""
        rng = random.Random(seed)
        target = self.rank_to_fail if self.rank_to_fail is not None else rng.randrange(world_size)
        if rank != target:
            return None
        kind = rng.choice(TIMED_KINDS[1:]) if self.fault_type == "random" else self.fault_type
        delay = self.base_delay + self.rand_delay * rng.random()
        sig = signal.SIGKILL if kind == "rank_killed" else signal.SIGSTOP
        print(f"simulated fault: {kind} on rank {rank} in {delay:.1f} s", flush=True)
        thread = threading.Thread(target=_fire_later, args=(delay, sig), daemon=True,
                                  name="ftrun-simulated-fault")  # fmt: skip
        thread.start()
        return thread


def _fire_later(delay: float, sig: signal.Signals) -> None:
    time.sleep(delay)
    os.kill(os.getpid(), sig)
