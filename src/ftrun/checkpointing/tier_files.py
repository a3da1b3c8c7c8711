"""The contract between a worker's `LocalCheckpointManager` and its node agent's checkpoint
keeper, under ft_launcher. Torch-free: the agent side imports it too.

The agent gives every worker `FTRUN_CKPT_DIR`: a 0700 directory in node memory (`/dev/shm`)
that the agent creates, keeps across worker restarts and removes at the job's end. A worker's
manager writes its parts there, in `DirectoryStore`'s layout under `<dir>/<session_id>/`
(`iter_<iteration>/rank<r>-of<w>.ftckpt`), so `save()` blocks only for the copy into node memory.
Parts that peers replicate to this node land in the same tree, named the same way: a node
holds a part whether its own ranks wrote it or a peer sent it.

Small JSON files per session, each written atomically (write, rename):
- `POLICY_FILE`, by the worker's manager: what the agent does with new parts off the training
  path (replicate to the clique's nodes; the copy on disk is the worker's own, `persist`).
- `RESTORE_FILE`, by the agent before the workers start: the iteration every rank of the job can
  load (complete for every rank somewhere, and fetched to this node for its ranks), or -1. The
  worker's `find_latest()` reads it instead of running a collective.
- `PROTECTED_FILE`, by the agent while the workers train: the newest iteration of which this
  node holds every part it should (its ranks' own parts and the replicas it receives). The
  manager's clean-up and the agent's never remove a part of it. Without it, a node could drop
  its own part of k after saving k+1 while the replicas of k+1 were still on their way: if a
  peer node died then, no iteration would be complete anywhere. Each node judges from what
  it holds: with several cliques, a job-wide complete iteration is certain only while every
  clique's replication keeps within `keep_complete - 1` saves of the newest (the agents do
  not agree on one protected iteration during training).
- `STALL_FILE` (one per rank), by the worker's manager after each save: how long that save
  blocked training (`{"iteration", "seconds"}`). The agent reports the longest of its ranks'
  with each newly protected iteration (the `ckpt_held` event: the save stall of the live view).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

POLICY_FILE = ".policy.json"
RESTORE_FILE = ".restore.json"
PROTECTED_FILE = ".protected.json"
STALL_FILE = ".stall-rank{rank}.json"


@dataclasses.dataclass(frozen=True)
class TierPolicy:
    """What the worker asks its agent to do with each new part."""

    replication_jump: int | None = None
    replication_factor: int | None = None
    """None: no replication (no strategy given)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TierPolicy:
        jump, factor = raw.get("replication_jump"), raw.get("replication_factor")
        for name, value in (("replication_jump", jump), ("replication_factor", factor)):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{POLICY_FILE}: {name} must be a positive int, not {value!r}")
        return cls(jump, factor)


@dataclasses.dataclass(frozen=True)
class RestoreDecision:
    """The iteration the job's ranks load after this round's rendezvous (-1: none); also the
    shape of `PROTECTED_FILE` (an iteration and the world size it was saved at)."""

    iteration: int
    world_size: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], name: str = RESTORE_FILE) -> RestoreDecision:
        iteration, world_size = raw.get("iteration"), raw.get("world_size")
        if type(iteration) is not int or type(world_size) is not int or world_size < 1:
            raise ValueError(f"{name}: not an iteration and a world size: {raw!r:.200}")
        return cls(iteration, world_size)


def session_dir(ckpt_dir: str | Path, session_id: str) -> Path:
    return Path(ckpt_dir) / (session_id or "default")


def write_json_atomically(path: Path, value: Mapping[str, Any]) -> None:
    """Readers see the old file or the new one, never half of one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
    except OSError:  # a full node memory, say: no half-written file left behind
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    """The file's object; None when it does not exist. Raises ValueError when it is not JSON."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    return raw
