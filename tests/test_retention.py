"""Which parts a rank removes after a write (`retention.parts_to_remove`): pure, no files."""

from __future__ import annotations

from ftrun.checkpointing.retention import parts_to_remove
from ftrun.checkpointing.store import PartKey
from ftrun.checkpointing.tier_files import RestoreDecision


def keys(*iterations: int, world_size: int = 4) -> list[PartKey]:
    return [PartKey(i, 1, world_size) for i in iterations]


def test_keeps_the_written_part_and_the_newest_complete_ones_below_it() -> None:
    written = PartKey(5, 1, 4)
    complete = keys(1, 2, 3, 5)
    present = keys(1, 2, 3, 4, 5)  # 4: a leftover of a write that never completed
    assert parts_to_remove(written, complete, present, 2, None) == keys(1, 2, 4)
    assert parts_to_remove(written, complete, present, 1, None) == keys(1, 2, 3, 4)
    assert parts_to_remove(written, complete, present, 9, None) == keys(4)


def test_parts_above_the_written_one_are_from_a_rolled_back_run() -> None:
    written = PartKey(3, 1, 4)
    assert parts_to_remove(written, keys(2, 3, 7), keys(2, 3, 7), 2, None) == keys(7)


def test_the_protected_iteration_stays_whatever_its_age() -> None:
    written = PartKey(5, 1, 4)
    present = keys(1, 2, 3, 5)
    protected = RestoreDecision(iteration=1, world_size=4)
    assert parts_to_remove(written, present, present, 1, protected) == keys(2, 3)
    # A protection at or above the written iteration adds nothing: the usual rule applies.
    newer = RestoreDecision(iteration=5, world_size=4)
    assert parts_to_remove(written, present, present, 1, newer) == keys(1, 2, 3)


def test_the_protected_part_is_of_its_own_world_size() -> None:
    written = PartKey(5, 1, 4)
    present = [PartKey(2, 1, 8), *keys(3, 5)]
    protected = RestoreDecision(iteration=2, world_size=8)
    assert parts_to_remove(written, keys(3, 5), present, 1, protected) == keys(3)
