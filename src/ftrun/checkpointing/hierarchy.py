"""`restore`: the newest complete iteration across the checkpoint tiers, with fallback.

NVRx's `HierarchicalCheckpointIO` loads the local checkpoint if its iteration is at least the
global one, else the global one, and stops there if that load fails. Here the tiers are a list,
fastest first (a `LocalCheckpointManager`: node memory under ft_launcher, which also covers the
agent's copies on local disk and at peers; local files under torchrun; then a
`GlobalCheckpointManager`), and a copy that is missing or corrupt sends every rank on to the
next best one:

1. each tier's newest iteration, agreed by every rank (one all_reduce MIN of the vector);
2. `choose`: the tier with the newest iteration; on a tie the earlier (faster) one;
3. load it; every rank reports the iteration it loaded, or -1 (one all_reduce); `judge` says
   whether to keep it, or to look again: a tier whose load failed is asked for its newest again
   (the global tier has set the bad iteration aside, so it answers an older one) and is dropped
   if that is not older; a local tier that fell back internally to an older iteration is kept
   only while no other tier has a newer one.

Collectives: those two per attempt, plus the tiers' own (`LocalCheckpointManager.find_latest`/
`load` under torchrun, the global tier's verification and DCP's load), on the default group
(CPU tensors, CUDA ones for an NCCL-only group). Every rank must call `restore` with the same
tiers in the same order. `choose` and `judge` are pure.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ftrun.checkpointing.async_progress import agree_min
from ftrun.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointUsageError,
)
from ftrun.checkpointing.global_tier import GlobalCheckpointManager
from ftrun.checkpointing.manager import LocalCheckpointManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What `restore` loaded. `state`: a local tier's loaded state (as `LocalCheckpointManager.
    load` returns it), or for the global tier the `state_dict` given, loaded in place."""

    iteration: int
    tier: str
    state: Any


class Tier(Protocol):
    """One place checkpoints are kept. Both methods may be collective (same order everywhere)."""

    name: str

    def newest(self) -> int:
        """The newest iteration this tier holds for every rank, or -1."""
        ...

    def load(self, iteration: int, state_dict: Any) -> tuple[Any, int]:
        """Load `iteration` (or, for a tier that cannot choose, its newest); (state, iteration).
        Raises a `CheckpointError` if it cannot."""
        ...


class LocalTier:
    """A `LocalCheckpointManager` as a tier: it loads its own newest (falling back inside),
    straight into `state_dict`'s tensors when one is given (`load(into=...)`)."""

    def __init__(self, manager: LocalCheckpointManager, name: str = "local") -> None:
        self.manager, self.name = manager, name

    def newest(self) -> int:
        return self.manager.find_latest()

    def load(self, iteration: int, state_dict: Any) -> tuple[Any, int]:
        state, ckpt_id = self.manager.load(into=state_dict)
        return state, ckpt_id.iteration


class GlobalTier:
    """A `GlobalCheckpointManager` as a tier: DCP loads into the `state_dict` given."""

    def __init__(self, manager: GlobalCheckpointManager, name: str = "global") -> None:
        self.manager, self.name = manager, name

    def newest(self) -> int:
        return self.manager.find_latest()

    def load(self, iteration: int, state_dict: Any) -> tuple[Any, int]:
        if state_dict is None:
            raise CheckpointUsageError("restore from a global checkpoint needs a state_dict")
        self.manager.load_iteration(state_dict, iteration)
        return state_dict, iteration


class Verdict(str, enum.Enum):
    """After a load attempt: keep what was loaded, or look again (the tier's newest changed,
    or the tier is dropped)."""

    ACCEPT = "accept"
    REQUERY = "requery"  # the load failed somewhere: ask the tier for its newest again
    RECHOOSE = "rechoose"  # loaded an older iteration than another tier has: drop it


def choose(newest: Sequence[int], dropped: frozenset[int] = frozenset()) -> int | None:
    """The tier to load from: the newest iteration, the earliest tier on a tie; None if none."""
    candidates = [i for i, iteration in enumerate(newest) if i not in dropped and iteration >= 0]
    return max(candidates, key=lambda i: (newest[i], -i), default=None)


def judge(
    newest: Sequence[int], tier: int, low: int, high: int, dropped: frozenset[int] = frozenset()
) -> Verdict:
    """What to do after loading from `tier`: `low`/`high` are the lowest and highest iteration
    the ranks loaded (-1 for a rank whose load failed)."""
    if low < 0 or low != high:
        return Verdict.REQUERY
    if low == newest[tier]:
        return Verdict.ACCEPT
    updated = [low if i == tier else n for i, n in enumerate(newest)]
    return Verdict.ACCEPT if choose(updated, dropped) == tier else Verdict.RECHOOSE


def restore(tiers: Sequence[Any], state_dict: Any = None) -> Restored:
    """Load the newest complete iteration across `tiers` (fastest first; managers or `Tier`s).

    `state_dict` is what a global checkpoint is loaded into (DCP's in-place load); it may be
    None if no tier is global. Raises `CheckpointNotFoundError` when no tier has a loadable
    iteration. Collective: see the module docstring.
    """
    adapted = [_as_tier(tier) for tier in tiers]
    newest = agree_min([tier.newest() for tier in adapted])
    dropped: set[int] = set()
    while (index := choose(newest, frozenset(dropped))) is not None:
        tier = adapted[index]
        state, loaded = _attempt(tier, newest[index], state_dict)
        low, neg_high = agree_min([loaded, -loaded])
        verdict = judge(newest, index, low, -neg_high, frozenset(dropped))
        if verdict is Verdict.ACCEPT:
            logger.info("restored iteration %d from the %s tier", low, tier.name)
            return Restored(low, tier.name, state)
        if verdict is Verdict.RECHOOSE:
            newest[index] = low
            continue
        again = agree_min([tier.newest()])[0]
        if again >= newest[index]:
            dropped.add(index)
        newest[index] = again
    names = ", ".join(tier.name for tier in adapted)
    raise CheckpointNotFoundError(f"no loadable checkpoint in any tier ({names})")


def _attempt(tier: Tier, iteration: int, state_dict: Any) -> tuple[Any, int]:
    """Load from `tier`; (state, iteration loaded), or (None, -1) if it failed here."""
    try:
        return tier.load(iteration, state_dict)
    except (CheckpointCorruptError, CheckpointNotFoundError) as e:
        logger.warning("the %s tier could not load iteration %d: %s", tier.name, iteration, e)
        return None, -1


def _as_tier(obj: Any) -> Tier:
    if isinstance(obj, LocalCheckpointManager):
        return LocalTier(obj)
    if isinstance(obj, GlobalCheckpointManager):
        return GlobalTier(obj)
    if all(hasattr(obj, attr) for attr in ("name", "newest", "load")):
        return obj
    raise CheckpointUsageError(f"not a checkpoint tier: {type(obj).__name__}")
