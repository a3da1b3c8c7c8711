"""`LocalCheckpointManager`: NVRx's local-checkpoint API over plain files on this node.

Each rank writes its own part of each iteration (see `store` for where, `part_write` for how).
Under plain torchrun the parts are files under `root_local_ckpt_dir`; under ft_launcher they
go to the node agent's memory (`tier_files`, `keeper.node_tier`), which keeps them across
worker restarts and replicates them to peers, behind the same `PartStore`; with
`persist_to_disk` (the default, as NVRx writes there) the save also copies the part under
`root_local_ckpt_dir` (`persist`).

Collectives: under plain torchrun, when `torch.distributed` is initialized, `find_latest` and
`load` are collective (every rank must call them, as in NVRx; see `collective`). Under
ft_launcher the agents agreed on the iteration before the workers started (`RESTORE_FILE`): no
collective. `save` is never collective.

Retention: after a successful write, the rank's older parts beyond `keep_complete` complete ones
are removed (`retention` says which, and why the default keeps 2).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ftrun.aside import Aside
from ftrun.checkpointing.async_calls import AsyncRequest
from ftrun.checkpointing.collective import all_true, min_max, rank_and_world_size
from ftrun.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointUsageError,
)
from ftrun.checkpointing.format import PartInfo
from ftrun.checkpointing.overlapped import OverlappedCopy
from ftrun.checkpointing.persist import copy_part
from ftrun.checkpointing.retention import parts_to_remove
from ftrun.checkpointing.state_dict import BasicTensorAwareStateDict, TensorAwareStateDict
from ftrun.checkpointing.store import DirectoryStore, PartKey, PartStore, PreparedPart
from ftrun.checkpointing.tier_files import POLICY_FILE
from ftrun.checkpointing.worker_tier import (
    agent_tier,
    note_stall,
    protected_part,
    restore_decision,
    write_policy,
)

logger = logging.getLogger(__name__)

WRAPPER_KEY = "ftrun.wrapper"  # in a part's metadata: the state was saved wrapped
_NO_BOUND = 2**62


class CkptID(NamedTuple):
    """What `load` loaded. NVRx's CkptID is a plain `(iteration, rank, session_id)` tuple: this
    one is that tuple (equal to it, unpacks and indexes like it), with names."""

    iteration: int
    rank: int
    session_id: str


class LocalCheckpointManager:
    """Saves and loads this rank's checkpoint parts.

    Under plain torchrun: files under `root_local_ckpt_dir/session_id`; `repl_strategy` is
    kept as `self.repl_strategy` but nothing is replicated (parts stay on this node).

    Under ft_launcher (`FTRUN_CKPT_DIR` set, see `tier_files`): parts go to node memory that the
    node agent keeps across worker restarts; the agent replicates each new part to the nodes of
    its `repl_strategy` clique off the training path, and before the workers start, agrees with
    the other agents on the iteration to resume from and fetches this node's missing parts from
    peers: `find_latest` and `load` then run no collective and read node memory. With
    `persist_to_disk` (default True: NVRx's files where NVRx users look) the save also copies
    the part to `root_local_ckpt_dir/session_id`, as under plain torchrun, before it returns (an
    async save, in its background thread); `persist_to_disk=False` keeps parts in memory and on
    peers only, which saves a disk write per save. A new job does not read the copies on disk
    under ft_launcher (its agents start with empty memory): resume a new job from the global
    tier.

    `keep_complete` is explained in `retention`; `store` replaces either store.
    """

    def __init__(
        self,
        root_local_ckpt_dir: str | Path,
        session_id: str = "",
        repl_strategy: Any = None,
        *,
        keep_complete: int = 2,
        store: PartStore | None = None,
        persist_to_disk: bool = True,
    ) -> None:
        if type(session_id) is not str or "/" in session_id or session_id in (".", ".."):
            raise CheckpointUsageError(f"session_id must be one path component, not {session_id!r}")
        if type(keep_complete) is not int or keep_complete < 1:
            raise CheckpointUsageError(f"keep_complete must be an int >= 1, not {keep_complete!r}")
        self.root_local_ckpt_dir = Path(root_local_ckpt_dir)
        self.session_id = session_id
        self.repl_strategy = repl_strategy
        self._keep_complete = keep_complete
        self._tier = agent_tier(session_id, repl_strategy)
        self._told_agent = self._tier is None or (self._tier / POLICY_FILE).exists()
        self._disk: DirectoryStore | None = None
        if store is None and self._tier is not None:
            store = DirectoryStore(self._tier, recycle=True)
            if persist_to_disk:
                self._disk = DirectoryStore(self.local_ckpt_dir)
        self._store = store if store is not None else DirectoryStore(self.local_ckpt_dir)
        self._in_flight: Aside[PartInfo] | None = None
        self._copy: OverlappedCopy | None = None  # an `overlap` save's, until `fence`
        self._joining = threading.Lock()  # `wait` (trainer) against `_join` (a queue's thread)
        self._bad: set[PartKey] = set()  # set aside: never read again, even if renaming failed
        if repl_strategy is not None and self._tier is None:
            logger.info(
                "%s given: parts are NOT replicated under plain torchrun; they stay on this "
                "node (replication to peers will be done by ft_launcher's agent)",
                repl_strategy,
            )

    def save(
        self,
        state_dict: Any,
        iteration: int,
        is_async: bool = False,
        *,
        overlap: bool = False,
        warm: int = 0,
    ) -> AsyncRequest | None:
        """Write this rank's part of `iteration`; with `is_async`, NVRx's `AsyncRequest` for
        the write in flight (schedule it on an `AsyncCallsQueue`, as NVRx's examples do, or
        ignore it and call `wait()`: either joins the write, and its error is raised once).

        Synchronous: returns when the part is durable and renamed into place, and older parts
        are removed. With `is_async`, the call blocks on: (1) the previous async save, if it
        is still running (one at a time; its error, if any, is raised here instead of starting
        this save); (2) flattening the state; (3) creating the part's temp file and reserving
        its size (a full disk fails here, in the caller); (4) the one copy of every tensor's
        bytes into that file's mapping (for CUDA tensors, the synchronous device-to-host
        copy). Then the caller may change or free its tensors: checksums, header, fsync,
        rename and clean-up run in a background thread, which `wait()` joins. Call `save`
        from one thread.

        `overlap` (an ftrun extension; implies `is_async`): (2)-(4) are not waited for either:
        the background thread flattens, maps and copies (CUDA tensors on a side stream, as of
        this call, into page-locked node memory: see `overlapped`). The caller must not change
        the saved tensors in place before `fence()` (`StepSnapshot` calls it from the
        optimizer's step). `warm` (with `overlap`): then `warm_up` for the next `warm` saves.
        """
        if type(iteration) is not int or iteration < 0:
            raise CheckpointUsageError(f"iteration must be a non-negative int, not {iteration!r}")
        started = time.monotonic()
        self.wait()
        key = PartKey(iteration, *rank_and_world_size())
        payload, metadata = _unwrap(state_dict)
        if not (is_async or overlap):
            self._after_write(key, self._store.write(key, payload, metadata))
            self._note_stall(key, started)
            return None
        if overlap:
            copy = OverlappedCopy()
            job = self._in_background(
                iteration,
                lambda: self._save_overlapped(key, copy, payload, metadata, warm),
                copy.abandon,
            )
            self._copy = copy
        else:
            pending = self._store.prepare(key, payload, metadata)
            job = self._in_background(iteration, lambda: self._commit(key, pending), pending.abort)
        with self._joining:
            self._in_flight = job
        self._note_stall(key, started)
        return AsyncRequest(self._join, (job,), [])

    def warm_up(self, state_dict: Any, iteration: int, parts: int) -> None:
        """Make node memory for this rank's next `parts` saves of states like `state_dict` in
        the background (mapped, page-locked for CUDA tensors; see `recycled`), so that none of
        them waits for new memory; `saving` holds meanwhile. `StepSnapshot` calls it."""
        self.wait()
        key = PartKey(iteration, *rank_and_world_size())
        payload, metadata = _unwrap(state_dict)
        self._in_flight = self._in_background(
            iteration, lambda: self._warm(key, payload, metadata, parts), _no_undo
        )

    def _warm(self, key: PartKey, payload: Any, metadata: dict[str, str], parts: int) -> None:
        warm = getattr(self._store, "warm", None)  # a store of node memory has it
        if parts and warm is not None:
            try:
                warm(key, payload, metadata, parts)
            except OSError as e:  # the saves then make their own files, as without it
                logger.warning("[rank %d] could not prepare memory for saves: %s", key.rank, e)

    def _save_overlapped(
        self, key: PartKey, copy: OverlappedCopy, payload: Any, metadata: dict[str, str], warm: int
    ) -> PartInfo:
        info = self._commit(key, copy.prepare(self._store, key, payload, metadata))
        self._warm(key, payload, metadata, warm)
        return info

    def _note_stall(self, key: PartKey, started: float) -> None:
        """Under ft_launcher, how long this save blocked the caller, for the agent's live view."""
        if self._tier is not None:
            note_stall(self._tier, key.rank, key.iteration, time.monotonic() - started)

    def fence(self) -> None:
        """Before the tensors of an `overlap` save change in place: wait until the host copies
        are done, and make the current CUDA stream wait for the device copies (no host wait)."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.fence()

    @property
    def saving(self) -> bool:
        """Whether a background save is still running."""
        job = self._in_flight
        return job is not None and not job.done(0)

    def wait(self) -> PartInfo | None:
        """Wait for the async save in flight; its `PartInfo`, or None if there was none.
        Raises the save's error (once)."""
        with self._joining:
            job, self._in_flight = self._in_flight, None
        return _joined(job) if job is not None else None

    def _join(self, job: Aside[PartInfo]) -> PartInfo | None:
        """The returned request's fn (an `AsyncCallsQueue` thread): join `job` unless `wait`
        already did, so that its error reaches the caller once."""
        with self._joining:
            if self._in_flight is not job:
                return None
            self._in_flight = None
        return _joined(job)

    @property
    def local_ckpt_dir(self) -> Path:
        """NVRx's name: where this manager's parts go under plain torchrun (and their copies on
        disk under ft_launcher): `root_local_ckpt_dir/session_id`, shared by the node's ranks
        (NVRx has a directory per rank below it; ftrun names each part by its rank)."""
        return self.root_local_ckpt_dir / self.session_id

    @property
    def rank(self) -> int:
        """NVRx's: this process's global rank."""
        return rank_and_world_size()[0]

    def find_latest(self, *, collective: bool = False) -> int:
        """The newest iteration for which every rank has a complete part (header checked,
        tensor bytes not read), or -1. Collective when torch.distributed is initialized.
        Under ft_launcher the agents' decision is used instead, unless `collective` (an ftrun
        extension: after an in-process restart, the parts are newer than that decision).

        One all-reduce of (min, -max) of each rank's newest: equal means every rank has it.
        Otherwise each rank looks again at or below the minimum (a rank may already have
        removed that iteration), until the ranks agree; the bound only goes down.
        """
        self._settle()
        rank, world_size = rank_and_world_size()
        agents = self._tier is not None and not collective
        if agents and (agreed := restore_decision(self._tier)) is not None:
            return agreed.iteration if agreed.world_size == world_size else -1
        bound = _NO_BOUND
        while True:
            mine = self._newest_at_most(bound, rank, world_size)
            low, high = min_max(mine)
            if low == high or low < 0:
                return low
            bound = low

    def newest_own(self) -> int:
        """This rank's newest complete part's iteration (header checked), or -1; not collective."""
        self._settle()
        return self._newest_at_most(_NO_BOUND, *rank_and_world_size())

    def read_own(self, iteration: int, into: Any) -> Any:
        """This rank's part of `iteration` read into `into` (checked as it lands); not
        collective. Raises `CheckpointNotFoundError` / `CheckpointCorruptError`."""
        key = PartKey(iteration, *rank_and_world_size())
        return self._store.read(key, verify=True, into=_unwrap(into)[0])[0]

    def load(self, into: Any = None, *, collective: bool = False) -> tuple[Any, CkptID]:
        """Load this rank's part of `find_latest()`; collective when distributed.

        Every tensor's checksum is verified. A part that fails is logged and set aside
        (renamed `*.corrupt`, never read again), and all ranks go back to the newest iteration
        they all still have. Returns `(state, ckpt_id)`, the state wrapped in a
        `BasicTensorAwareStateDict` if it was saved wrapped. Tensors are zero-copy views of the
        file (see `format`): load them into the model, then drop them.

        `into` (an ftrun extension, in place like `torch.distributed.checkpoint.load`): a state
        of the saved structure whose tensors are the model's, e.g. `{"model":
        model.state_dict(), ...}`; each tensor is read straight into it and checked as it
        lands, one pass over the bytes instead of a check and a copy (see `read_into`). The
        returned state holds those tensors. After a corrupt part it has been partly
        overwritten, and the next copy loaded overwrites it again. `collective`: as for
        `find_latest`.
        """
        target = _unwrap(into)[0] if into is not None else None
        self._settle()
        rank, world_size = rank_and_world_size()
        while True:
            iteration = self.find_latest(collective=collective)
            if iteration < 0:
                raise CheckpointNotFoundError(
                    f"no complete checkpoint for rank {rank} of {world_size} in {self._store}"
                )
            key = PartKey(iteration, rank, world_size)
            loaded: tuple[Any, PartInfo] | None = None
            try:
                loaded = self._store.read(key, verify=True, into=target)
            except (CheckpointCorruptError, CheckpointNotFoundError) as e:
                self._set_aside(key, e)
            agents = self._tier is not None and not collective
            if agents and loaded is None:
                # The agents chose this iteration for every rank: a bad part is for them to
                # replace (a replica, or an older iteration) at the restart this error causes.
                raise CheckpointCorruptError(f"rank {rank}: part of iteration {iteration} is bad")
            agreed = agents or all_true(loaded is not None)
            if agreed and loaded is not None:
                state, info = loaded
                logger.info(
                    "[rank %d] loaded iteration %d (%d bytes)", rank, iteration, info.nbytes
                )
                return _rewrap(state, info), CkptID(iteration, rank, self.session_id)

    @staticmethod
    def _in_background(
        iteration: int, work: Callable[[], PartInfo | None], undo: Callable[[], None]
    ) -> Aside[PartInfo]:
        try:
            # Not a daemon: a save the caller was told had started completes before exit.
            return Aside(work, f"ftrun-ckpt-save-{iteration}", daemon=False)
        except BaseException:  # no thread (e.g. none can be started): drop the temp file
            undo()
            raise

    def _commit(self, key: PartKey, pending: PreparedPart) -> PartInfo:
        info = pending.commit()
        self._after_write(key, info)
        return info

    def _after_write(self, key: PartKey, info: PartInfo) -> None:
        logger.debug("[rank %d] saved iteration %d: %s", key.rank, key.iteration, info.path)
        self._bad.discard(key)  # written anew: the part set aside under this key is not it
        if not self._told_agent:  # node memory was full when this manager started
            self._told_agent = write_policy(self._tier, self.repl_strategy)
        if self._disk is not None:
            copy_part(info.path, self._disk.path_of(key))
        for store in (self._store, self._disk):
            try:
                if store is not None:
                    self._remove_others(store, key)
            except OSError as e:  # a failed clean-up must not fail the save that succeeded
                logger.warning("[rank %d] could not remove old parts: %s", key.rank, e)

    def _remove_others(self, store: PartStore, key: PartKey) -> None:
        complete = store.list(key.rank, key.world_size)
        protected = protected_part(self._tier) if self._tier is not None else None
        present = store.list(key.rank, key.world_size, complete_only=False)
        for other in parts_to_remove(key, complete, present, self._keep_complete, protected):
            if other.iteration > key.iteration:
                logger.info(
                    "[rank %d] removing iteration %d, newer than %d: left by a rolled-back run",
                    key.rank,
                    other.iteration,
                    key.iteration,
                )
            store.remove(other)

    def _newest_at_most(self, bound: int, rank: int, world_size: int) -> int:
        for key in reversed(self._store.list(rank, world_size)):
            if key.iteration > bound or key in self._bad:
                continue
            try:
                self._store.info(key)
                return key.iteration
            except CheckpointCorruptError as e:
                self._set_aside(key, e)
            except CheckpointNotFoundError:
                continue  # removed since it was listed
        return -1

    def _set_aside(self, key: PartKey, error: CheckpointError) -> None:
        logger.warning(
            "[rank %d] setting aside the part of iteration %d: %s", key.rank, key.iteration, error
        )
        self._bad.add(key)
        try:
            self._store.set_aside(key)
        except OSError as e:
            logger.warning("[rank %d] could not set aside %s: %s", key.rank, key, e)

    def _settle(self) -> None:
        """Let the save in flight finish before looking; its error is logged, not raised."""
        try:
            self.wait()
        except CheckpointError as e:
            logger.error("the background save failed: %s", e)


def _no_undo() -> None:
    pass


def _joined(job: Aside[PartInfo]) -> PartInfo:
    """The background write's `PartInfo` once it ends, or its error raised here."""
    job.done(None)
    return job.result()


def _unwrap(state_dict: Any) -> tuple[Any, dict[str, str]]:
    if isinstance(state_dict, BasicTensorAwareStateDict):
        return state_dict.state_dict, {WRAPPER_KEY: "BasicTensorAwareStateDict"}
    if isinstance(state_dict, TensorAwareStateDict):
        raise CheckpointUsageError(
            f"{type(state_dict).__name__}: ftrun stores plain state dicts and "
            "BasicTensorAwareStateDict only (another TensorAwareStateDict would need pickle)"
        )
    return state_dict, {}


def _rewrap(state: Any, info: PartInfo) -> Any:
    wrapped = info.metadata.get(WRAPPER_KEY) == "BasicTensorAwareStateDict"
    return BasicTensorAwareStateDict(state) if wrapped else state
