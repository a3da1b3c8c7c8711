"""The in-process restart state of one rank (NVRx's `inprocess.state`).

`State` is what the wrapper mutates between restart iterations; every user hook (abort,
finalize, health check, initialize, ...) receives a `FrozenState` snapshot so that a hook cannot
change what the wrapper decides on.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import os
from collections.abc import Iterable


class Mode(str, enum.Enum):
    """What a rank does in the current restart iteration.

    INITIALIZED: state created, no rank assignment has run yet.
    ACTIVE: the rank calls the wrapped function.
    INACTIVE: the rank waits idle (a reserve rank).
    TERMINATED: the rank left the job (discarded by rank assignment or unhealthy).

    A `str` enum (NVRx's are ints) so that a mode can travel through a store as text.
    """

    INITIALIZED = "initialized"
    ACTIVE = "active"
    INACTIVE = "inactive"
    TERMINATED = "terminated"


@dataclasses.dataclass
class State:
    """The wrapper's view of this rank.

    `rank`/`world_size` number the ranks the wrapper controls (terminated ranks have rank None);
    `active_rank`/`active_world_size` are what the wrapped function sees (None while inactive);
    `initial_*` are captured once, when the wrapper was first called, and default to
    `rank`/`world_size`. `fn_exception` is what the wrapped function raised in this iteration.
    """

    rank: int | None
    world_size: int
    active_rank: int | None = None
    active_world_size: int | None = None
    initial_rank: int | None = None
    initial_world_size: int | None = None
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None

    def __post_init__(self) -> None:
        _initial_defaults(self)

    @classmethod
    def from_env(cls) -> State:
        """The state of a fresh wrapper from the launcher's RANK and WORLD_SIZE."""
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(rank=rank, world_size=world_size)

    def set_distributed_vars(self) -> None:
        """Publish the active rank and world size as RANK/WORLD_SIZE for the wrapped function,
        which initializes torch.distributed from the environment (as NVRx: unset values are
        written as "None")."""
        os.environ["RANK"] = str(self.active_rank)
        os.environ["WORLD_SIZE"] = str(self.active_world_size)

    def advance(self) -> None:
        """Move to the next restart iteration; the previous iteration's exception is spent."""
        self.iteration += 1
        self.fn_exception = None

    def freeze(self) -> FrozenState:
        """A read-only snapshot for user hooks. Shallow: `fn_exception` is the same object
        (NVRx deep-copies it, which fails for exceptions that cannot be copied)."""
        return FrozenState(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def copy_from(self, other: State | FrozenState, fields: Iterable[str] | None = None) -> None:
        """Take `fields` (all of them when None) from `other`."""
        wanted = None if fields is None else set(fields)
        for field in dataclasses.fields(self):
            if wanted is None or field.name in wanted:
                setattr(self, field.name, getattr(other, field.name))


def _initial_defaults(state: object) -> None:
    """`initial_rank`/`initial_world_size` default to `rank`/`world_size`: a `State`'s, and a
    `FrozenState`'s made directly (tests, user code)."""
    for initial, current in (("initial_rank", "rank"), ("initial_world_size", "world_size")):
        if getattr(state, initial) is None:
            object.__setattr__(state, initial, getattr(state, current))


class Hook(abc.ABC):
    """The base of the wrapper's hooks (`Abort`, `Finalize`, `HealthCheck`, `Initialize`,
    `Completion`, `Terminate`): called with a `FrozenState`; compose several with `Compose`."""

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        """Do the work (a check raises) and return `state` unchanged (the next composed stage
        gets it)."""
        raise NotImplementedError


FrozenState = dataclasses.make_dataclass(
    "FrozenState",
    [
        (f.name, f.type) if f.default is dataclasses.MISSING
        else (f.name, f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(State)
    ],
    frozen=True,
    namespace={"__post_init__": _initial_defaults, "__module__": __name__,
               "__doc__": "`State` with every field read-only (what hooks get)."},
)  # fmt: skip
