"""Which of a rank's local parts to remove after it wrote a new one (pure: no files touched).

After a successful write of iteration k, this rank's parts other than k and its
`keep_complete - 1` newest complete parts below k are removed, leftovers included. Parts
above k are from a run that was rolled back, and go too. Ranks clean up independently: with
`keep_complete=1`, if one rank finishes writing k+1 (and drops k) while another dies before
finishing it, no iteration is complete on both and `find_latest` says -1 (rather than load
mismatched iterations): the crash during a save that local checkpoints exist for. So the
default keeps 2 complete parts (plus the one being written). Under ft_launcher the part of the
iteration the agent protects (`PROTECTED_FILE`: the newest one this node holds whole, replicas
included) is kept too, whatever its age: replicas travel after the save, and a node lost in
between must leave its peers a complete iteration.
"""

from __future__ import annotations

from collections.abc import Sequence

from ftrun.checkpointing.store import PartKey
from ftrun.checkpointing.tier_files import RestoreDecision


def parts_to_remove(
    written: PartKey,
    complete: Sequence[PartKey],
    present: Sequence[PartKey],
    keep_complete: int,
    protected: RestoreDecision | None,
) -> list[PartKey]:
    """Of `present` (this rank's parts, complete or not), those to remove now that `written`
    is written; `complete` lists the complete ones in iteration order, `protected` is the
    agent's protected iteration if any."""
    older = [k for k in complete if k.iteration < written.iteration]
    keep = {written, *older[max(0, len(older) - (keep_complete - 1)) :]}
    if protected is not None and protected.iteration < written.iteration:
        keep.add(PartKey(protected.iteration, written.rank, protected.world_size))
    return [other for other in present if other not in keep]
