"""`StepSnapshot`: the training state in node memory every step, restored with one call.

What a fault costs a job is its detection and recovery, plus the steps redone since the last
checkpoint and the stalls of the saves in between. Saving every step removes the redone steps
only if a save costs (almost) nothing, so a snapshot here is a `LocalCheckpointManager` part
written with `overlap`:

- `save(state, step)` takes the state's `state_dict()`s and marks the caller's CUDA stream, then
  returns. A background thread flattens the state, maps its part in node memory (`/dev/shm`),
  queues the CUDA tensors' copies on a side stream (page-locked, as of the mark), copies the
  host tensors, checksums the part and renames it into place, while the next step computes
  (`overlapped`). The step's stall is the `state_dict()` calls.
- The state must not change until the copies are done: the snapshot holds every optimizer's
  `step()` until then (a global step pre-hook calling `LocalCheckpointManager.fence`: the host
  copies are waited for; for the device copies the current stream waits, not the host). Code
  that changes saved tensors in place outside an optimizer step calls `fence()` first.
- A save whose background write failed (node memory full, say) is logged and counted
  (`failed`); the newest complete snapshot stays, and the next save is tried: a snapshot's
  failure never stops the training (`wait()` and `close()` do raise it).
- A save that finds the previous one still in the background is skipped (`skipped` counts them):
  the newest snapshot is then a step older, but the training never waits for node memory.
  Nor for new memory: the files the saves rotate through are made (mapped, page-locked) in the
  background after a restore, or after a process's first save (a new file costs ~7x its copy);
  saves due meanwhile are skipped. Page-locking still holds the process's kernel launches
  (CUDA's driver: 95 ms for 1.7 GB on an H100), once per file and process.
- Where each copy lives: the part is a file in node memory, so it outlives the rank's process.
  Under ft_launcher that memory is the agent's (`FTRUN_CKPT_DIR`), which keeps it across the
  workers' restarts, replicates it to the agents of another node's ranks (one clique per rank
  across two nodes: `replication_jump` = ranks per node), and before a round starts, fetches a
  replaced node's parts from the nodes holding them. Elsewhere (plain torchrun, a script run by
  hand) it is a 0700 directory of this user's under /dev/shm, named after the job.

`restore(state)`, one call, the newest step every rank can load: with torch.distributed
initialized, the ranks agree on it among themselves (`find_latest(collective=True)`: one or two
all-reduces, at restore time only); the agents' decision otherwise. Each rank loads its own
part of that one step (steps are never mixed across ranks), checksums verified, straight into
the state's tensors. Each tier reaches the fastest copy that exists through it: an in-process
restart and a rank replaced on its node read node memory; a node replaced by a spare reads the
parts its agent fetched from peers; a relaunched job finds none and starts from the global
tier (`GlobalCheckpointManager`, `restore`), as the user's script decides.

A state is a dict whose values are objects with `state_dict()`/`load_state_dict()` (a model,
an optimizer, a scheduler: saved through those), or plain values (tensors, numbers, strings,
nested dicts of them: given back in the dict). DTensor values (FSDP2) are saved as their local
shards and restored into them; an FSDP2 optimizer that has no state yet gets it from one step
with zero gradients before it is restored (its values are then overwritten).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ftrun.checkpointing.errors import (
    CheckpointNotFoundError,
    CheckpointUsageError,
    CheckpointWriteError,
)
from ftrun.checkpointing.manager import LocalCheckpointManager
from ftrun.checkpointing.peer_restore import restore_from_peer
from ftrun.checkpointing.replication import CliqueReplicationStrategy
from ftrun.checkpointing.store import DirectoryStore
from ftrun.environment import Env

logger = logging.getLogger(__name__)

SESSION = "step-snapshots"
KEEP_COMPLETE = 2


class StepSnapshot:
    """Every step's training state in node memory (see the module docstring).

    `every`: save every `every` steps (1: every step). `directory`: where the parts go when not
    under ft_launcher (default: a 0700 directory under /dev/shm named after the job).
    `replicate`: under ft_launcher, copy each part to another node's agent (default: when the
    job has at least two nodes' worth of ranks)."""

    def __init__(
        self, directory: str | Path | None = None, *, every: int = 1, replicate: bool = True
    ) -> None:
        if type(every) is not int or every < 1:
            raise CheckpointUsageError(f"every must be an int >= 1, not {every!r}")
        self.every = every
        self.taken = 0
        self.skipped = 0
        self.failed = 0
        """Saves whose background write failed (said in the log; the next one is tried)."""
        self.stalls: list[float] = []
        """Seconds each taken save held the caller."""
        self._sharded: bool | None = None  # whether the first save found DTensors
        self._warm = False  # whether this process made its saves' memory (`warm_up`)
        under_agent = Env.CKPT_DIR in os.environ
        # Under the agent the parts go to its node memory (nothing persisted under `root`):
        # no directory of our own to make.
        root = Path(directory or os.environ.get(Env.CKPT_DIR) or default_directory())
        self._manager = LocalCheckpointManager(
            root,
            SESSION,
            _clique_across_nodes() if replicate else None,
            keep_complete=KEEP_COMPLETE,
            # The agent's store reuses retired parts' page-locked files; so does this one
            # elsewhere, or every save would map (and not pin) a new file.
            store=None if under_agent else DirectoryStore(root / SESSION, recycle=True),
            persist_to_disk=False,
        )
        self._hook = register_optimizer_step_pre_hook(lambda *_: self._manager.fence())

    def save(self, state: Mapping[str, Any], step: int) -> bool:
        """Snapshot `state` as of `step` (steps done) if due and the previous one is done;
        whether it was taken. Not collective; call it between optimizer steps."""
        if step % self.every:
            return False
        if self._manager.saving:
            self.skipped += 1
            return False
        try:
            self._manager.wait()
        except CheckpointWriteError as e:  # node memory full, say: the training goes on
            self.failed += 1
            logger.warning("a step snapshot failed (%s); the newest one stays, trying again", e)
        started = time.perf_counter()
        saved = {key: _state_of(value) for key, value in state.items()}
        if self._sharded is not False:  # a walk of the state, needed only where DTensors are
            found: list[bool] = []
            saved = _local(saved, found)
            self._sharded = bool(found)
        # The first save of a process makes its own file, then the rotation's others.
        warm = 0 if self._warm else KEEP_COMPLETE
        self._warm = True
        self._manager.save(saved, step, overlap=True, warm=warm)
        self.stalls.append(time.perf_counter() - started)
        self.taken += 1
        return True

    def restore(self, state: dict[str, Any], *, replicated: bool = False) -> int:
        """Load the newest step every rank holds into `state`; that step, or 0 when there is
        none. Collective when torch.distributed is initialized (every rank calls it).

        `replicated`: `state` is the same on every rank (DDP's model and optimizer); a rank
        lacking the newest step any rank holds gets it from the lowest rank holding it, by
        broadcast (see `peer_restore`), instead of every rank going back to an older one."""
        self._manager.fence()
        collective = dist.is_available() and dist.is_initialized()
        _materialize(state, sharded_only=True)
        live = {key: _state_of(value) for key, value in state.items()}
        into = _local(live)
        try:
            found = None
            if replicated and collective:
                found = restore_from_peer(self._manager, into, lambda: _prepared(state))
            if found is None:
                loaded, ckpt = self._manager.load(into=into, collective=collective)
                found = loaded, ckpt.iteration
        except CheckpointNotFoundError:
            return 0
        loaded, step = found
        for key, value in state.items():
            restored = _with_dtensors(loaded[key], live[key])
            if _is_stateful(value):
                value.load_state_dict(restored)
            else:
                state[key] = restored
        logger.info("restored the step snapshot of step %d", step)
        if not self._warm:  # the memory of the saves to come, while training resumes
            self._warm = True
            saved = _local({key: _state_of(value) for key, value in state.items()})
            self._manager.warm_up(saved, step, parts=KEEP_COMPLETE + 1)
        return step

    def fence(self) -> None:
        """Before changing saved tensors in place outside an optimizer step."""
        self._manager.fence()

    def wait(self) -> None:
        """Wait for the snapshot in the background; raises its error."""
        self._manager.fence()
        self._manager.wait()

    def close(self) -> None:
        """Finish the snapshot in flight and stop holding optimizer steps."""
        self._hook.remove()
        self.wait()


def default_directory(shm: Path = Path("/dev/shm")) -> Path:
    """Node memory: the agent's under ft_launcher (the manager finds it itself); else
    /dev/shm/ftrun-snapshots-<uid>/<job>, 0700, surviving the workers' restarts."""
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "local"
    root = shm / f"ftrun-snapshots-{os.getuid()}"
    for directory in (root, root / job.replace("/", "_")):
        directory.mkdir(mode=0o700, exist_ok=True)
        found = directory.lstat()  # not a link another user planted: this user's, 0700
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
            raise CheckpointUsageError(f"{directory}: not a 0700 directory of this user")
    return root / job.replace("/", "_")


def _clique_across_nodes() -> CliqueReplicationStrategy | None:
    """Each rank's part also on the node of rank + ranks-per-node (NVRx's clique, J = the
    node's ranks, F = 2), when the job spans a multiple of two nodes' ranks; else None."""
    if Env.CKPT_DIR not in os.environ:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if per_node < 1 or world % (2 * per_node):
        return None
    return CliqueReplicationStrategy(replication_jump=per_node, replication_factor=2)


def _is_stateful(value: Any) -> bool:
    return all(callable(getattr(value, name, None)) for name in ("state_dict", "load_state_dict"))


def _state_of(value: Any) -> Any:
    return value.state_dict() if _is_stateful(value) else value


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def _local(value: Any, found: list[bool] | None = None) -> Any:
    """`value` with each DTensor replaced by its local shard (sharing its memory); `found`
    gets an entry if there was one."""
    if _is_dtensor(value):
        if found is not None:
            found.append(True)
        # The shard itself: `to_local()` is an autograd function, 5-10 us a tensor on every save.
        shard = getattr(value, "_local_tensor", None)
        return shard if shard is not None else value.to_local()
    if isinstance(value, dict):
        return {key: _local(item, found) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(item, found) for item in value)
    return value


def _with_dtensors(loaded: Any, live: Any) -> Any:
    """`loaded` with the live DTensors put back where `live` had them (their local shards hold
    the loaded values already: the load read into them)."""
    if _is_dtensor(live):
        return live
    if isinstance(loaded, dict) and isinstance(live, dict):
        return {key: _with_dtensors(item, live.get(key)) for key, item in loaded.items()}
    if isinstance(loaded, list | tuple) and isinstance(live, list | tuple):
        pairs = zip(loaded, [*live, *[None] * (len(loaded) - len(live))], strict=False)
        return type(loaded)(_with_dtensors(item, other) for item, other in pairs)
    return loaded


def _prepared(state: dict[str, Any]) -> dict[str, Any]:
    """A peer restore's receiving side: every optimizer with state, then the live state."""
    _materialize(state, sharded_only=False)
    return _local({key: _state_of(value) for key, value in state.items()})


def _materialize(state: dict[str, Any], sharded_only: bool) -> None:
    for value in state.values():
        if isinstance(value, torch.optim.Optimizer):
            _materialize_optimizer(value, sharded_only)


@torch.no_grad()
def _materialize_optimizer(optimizer: torch.optim.Optimizer, sharded_only: bool) -> None:
    """An optimizer without state: one step with zero gradients creates it (which the restore
    then overwrites, the parameters' values too), so that it can be loaded into: needed for
    DTensor parameters (a plain tensor loaded into it would not become a DTensor) and for a
    state received from a peer (received into the live tensors)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or (sharded_only and not any(_is_dtensor(p) for p in params)):
        return
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
