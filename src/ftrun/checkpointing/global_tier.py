"""`GlobalCheckpointManager`: sharded checkpoints in a shared directory through DCP's
`async_save`, visible only when complete, checksummed, loaded without unrestricted unpickling.

A save (every rank calls it, in the same order):
1. waits for the previous save to be finalized (one at a time: its staged buffers are reused);
2. agrees on a fresh token (one broadcast on the checkpoint group) and names a hidden
   directory, `.iter_<iteration>.<token>.tmp` (see `global_files`);
3. calls `torch.distributed.checkpoint.async_save` with a `FileSystemWriter` on it and
   `dcp_safe.ReusingStager`: the caller stalls for one copy of the tensors into buffers kept
   from the previous save; DCP plans, writes (fsync) and writes `.metadata` in its thread, its
   collectives on a gloo group of its own (so they never interleave with the training's);
4. hands an `AsyncRequest` to an `AsyncCallsQueue`: its fn waits for DCP's future, then
   checksums this rank's files and leaves a sidecar; once every rank is done (the queue's one
   all_reduce), rank 0's finalize writes the MANIFEST (sizes, CRC-32C), fsyncs, renames the
   directory to `iter_<iteration>`, fsyncs the root, then applies `keep_last` and removes
   abandoned hidden directories.

A failure anywhere (a write that raises, a rank that dies, a stuck write past `timeout_s`) is an
`AsyncCallError` on every rank from `maybe_finalize`/`save`/`close`, and nothing is renamed: a
crash during a save leaves a hidden directory that no reader looks at and the next save removes.

Load (`load_iteration`, collective): every rank checks its share of the files against the
MANIFEST, the ranks agree (one all_reduce), and only then does DCP read, through
`dcp_safe.SafeFileSystemReader` and `SafeLoadPlanner`. A checkpoint that fails either step is
`CheckpointCorruptError` on every rank and is set aside (`iter_<n>.corrupt`): never read again.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from ftrun.checkpointing import global_files as gf
from ftrun.checkpointing.async_calls import AsyncCallsQueue, AsyncRequest
from ftrun.checkpointing.async_progress import agree_min, distributed
from ftrun.checkpointing.dcp_safe import ReusingStager, SafeFileSystemReader, SafeLoadPlanner
from ftrun.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointUsageError,
    CheckpointWriteError,
)
from ftrun.checkpointing.persist import fsync_dir

logger = logging.getLogger(__name__)

_GROUP_TIMEOUT_MARGIN_S = 60.0


@dataclass(frozen=True)
class GlobalCheckpointConfig:
    """Where and how the global tier saves. `keep_last`: complete iterations kept (>= 1);
    `timeout_s`: how long a save may run before every rank raises; `sync_files`: fsync DCP's
    files (DCP's own default, needed for the atomicity promise); `thread_count`: DCP's writer
    threads per rank."""

    root_dir: Path
    keep_last: int = 2
    timeout_s: float = 600.0
    sync_files: bool = True
    thread_count: int = 1

    def __post_init__(self) -> None:
        if type(self.keep_last) is not int or self.keep_last < 1:
            raise CheckpointUsageError(f"keep_last must be an int >= 1, not {self.keep_last!r}")
        if not self.timeout_s > 0:
            raise CheckpointUsageError(f"timeout_s must be > 0, not {self.timeout_s!r}")
        if type(self.thread_count) is not int or self.thread_count < 1:
            raise CheckpointUsageError(f"thread_count must be >= 1, not {self.thread_count!r}")


class GlobalCheckpointManager:
    """Saves and loads sharded checkpoints of every rank in `root_dir` (shared storage).

    Constructing it is collective when torch.distributed is initialized and no
    `process_group` is given: it creates a gloo group for DCP's background collectives.
    """

    def __init__(
        self,
        root_dir: str | Path,
        *,
        keep_last: int = 2,
        timeout_s: float = 600.0,
        sync_files: bool = True,
        thread_count: int = 1,
        process_group: Any = None,
    ) -> None:
        self.config = GlobalCheckpointConfig(
            Path(root_dir), keep_last, float(timeout_s), sync_files, thread_count
        )
        self.config.root_dir.mkdir(parents=True, exist_ok=True)
        if process_group is None and distributed():
            timeout = datetime.timedelta(seconds=self.config.timeout_s + _GROUP_TIMEOUT_MARGIN_S)
            process_group = dist.new_group(backend="gloo", timeout=timeout)
        self._pg = process_group
        self._queue = AsyncCallsQueue(persistent=True, timeout=self.config.timeout_s)
        self._stager = ReusingStager()
        self._bad: set[int] = set()
        self._iterations: dict[int, int] = {}  # call index -> iteration, until finalized

    @property
    def root_dir(self) -> Path:
        return self.config.root_dir

    def save(self, state_dict: dict[str, Any], iteration: int, is_async: bool = True) -> None:
        """Save every rank's `state_dict` as `iteration` (collective). With `is_async` it
        returns once the tensors are staged; `maybe_finalize` makes it visible later."""
        if type(iteration) is not int or iteration < 0:
            raise CheckpointUsageError(f"iteration must be a non-negative int, not {iteration!r}")
        self._queue.maybe_finalize_async_calls(blocking=True)
        tmp = self.root_dir / gf.tmp_dir_name(iteration, self._agree_token())
        writer = FileSystemWriter(
            tmp, sync_files=self.config.sync_files, thread_count=self.config.thread_count
        )
        future = dcp.async_save(state_dict, storage_writer=writer, async_stager=self._stager,
                                process_group=self._pg, no_dist=self._pg is None)  # fmt: skip
        request = AsyncRequest(
            self._checksum_own_files, (future, tmp), [partial(self._publish, iteration, tmp)]
        )
        if is_async:
            self._iterations[self._queue.schedule_async_request(request)] = iteration
        else:
            request.execute_sync()

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Publish the saves done on every rank (collective while one is pending); their
        iterations. Raises `AsyncCallError` for a save that failed on any rank."""
        iterations = dict(self._iterations)
        try:
            done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        finally:  # settled calls (finalized or failed) are the oldest ones
            settled = len(self._iterations) - self._queue.get_num_unfinalized_calls()
            for idx in sorted(self._iterations)[: max(0, settled)]:
                del self._iterations[idx]
        return [iterations[idx] for idx in done if idx in iterations]

    def close(self, abort: bool = False) -> None:
        """Finalize the save in flight (collective), or with `abort` drop it (nothing published)."""
        try:
            self._queue.close(abort=abort)
        finally:
            self._stager.close()

    def find_latest(self) -> int:
        """The newest iteration with a visible directory and a valid MANIFEST, or -1. Reads the
        directory only (no collective, file contents not checked)."""
        for iteration in reversed(gf.list_visible(self.root_dir)):
            if iteration in self._bad:
                continue
            try:
                self._read_manifest(iteration)
            except (OSError, ValueError):
                continue
            return iteration
        return -1

    def load(self, state_dict: dict[str, Any]) -> int:
        """Load the newest loadable iteration into `state_dict` (in place, DCP's way), falling
        back past corrupt ones; its iteration. Collective."""
        while True:
            iteration = agree_min([self.find_latest()])[0]  # the lowest: every rank has it
            if iteration < 0:
                raise CheckpointNotFoundError(f"no complete global checkpoint in {self.root_dir}")
            try:
                self.load_iteration(state_dict, iteration)
                return iteration
            except CheckpointCorruptError as e:
                logger.warning("global checkpoint %d is bad, trying an older one: %s", iteration, e)

    def load_iteration(self, state_dict: dict[str, Any], iteration: int) -> None:
        """Verify `iteration` against its MANIFEST on every rank, then DCP-load it into
        `state_dict`. Collective. `CheckpointCorruptError` on every rank if it is bad."""
        directory = self.root_dir / gf.iter_dir_name(iteration)
        problem = self._verify_share(iteration, directory)
        if agree_min([0 if problem else 1])[0] == 0:
            self._set_aside(iteration, problem or "a file failed its check on another rank")
        try:
            dcp.load(state_dict, storage_reader=SafeFileSystemReader(directory),
                     planner=SafeLoadPlanner(), process_group=self._pg,
                     no_dist=self._pg is None)  # fmt: skip
        except Exception as e:  # DCP gathers every rank's error: all ranks are here
            self._set_aside(iteration, f"DCP could not load it: {type(e).__name__}: {e}")
        logger.info("loaded global checkpoint %d from %s", iteration, directory)

    def _verify_share(self, iteration: int, directory: Path) -> str | None:
        """Check this rank's share of the files; what is wrong, or None."""
        try:
            manifest = self._read_manifest(iteration)
            rank, world_size = self._rank_and_world_size()
            names = gf.files_of_rank(manifest.files, rank, world_size)
            gf.verify_files(directory, names, manifest)
        except (OSError, ValueError) as e:
            return str(e)
        return None

    def _read_manifest(self, iteration: int) -> gf.Manifest:
        path = self.root_dir / gf.iter_dir_name(iteration) / gf.MANIFEST
        manifest = gf.decode_manifest(path.read_bytes())
        if manifest.iteration != iteration:
            raise ValueError(f"the manifest is for iteration {manifest.iteration}")
        return manifest

    def _set_aside(self, iteration: int, why: str) -> None:
        """Mark `iteration` bad here (and on disk, from rank 0), then raise for it."""
        self._bad.add(iteration)
        name = gf.iter_dir_name(iteration)
        logger.error("global checkpoint %s is bad, setting it aside: %s", name, why)
        if self._rank_and_world_size()[0] == 0:
            target = self.root_dir / f"{name}.corrupt"
            if target.exists():
                target = self.root_dir / f"{name}.corrupt.{random.getrandbits(64):016x}"
            try:
                os.rename(self.root_dir / name, target)
            except OSError as e:
                logger.warning("could not set aside %s: %s", name, e)
        raise CheckpointCorruptError(f"global checkpoint {name}: {why}")

    def _checksum_own_files(self, future: Any, tmp: Path) -> None:
        """The background part after DCP's: checksum this rank's files into a sidecar."""
        with _one_line_errors(tmp):
            future.result()  # DCP's own error, if any, fails the call on every rank
            rank, world_size = self._rank_and_world_size()
            entries = {
                name: gf.file_entry(tmp / name)
                for name in gf.files_of_rank(os.listdir(tmp), rank, world_size)
            }
            gf.write_durably(tmp / gf.sidecar_name(rank), gf.encode_entries(entries))

    def _publish(self, iteration: int, tmp: Path) -> None:
        """Rank 0, once every rank's files are written: MANIFEST, fsync, rename, retention."""
        rank, world_size = self._rank_and_world_size()
        if rank != 0:
            return
        with _one_line_errors(tmp):
            entries: dict[str, gf.FileEntry] = {}
            for r in range(world_size):
                entries.update(gf.decode_entries((tmp / gf.sidecar_name(r)).read_bytes()))
            on_disk = set(gf.files_of_rank(os.listdir(tmp), 0, 1))  # every data file
            if set(entries) != on_disk or gf.DCP_METADATA not in entries:
                raise CheckpointWriteError(
                    f"{tmp.name}: the checksummed files {sorted(entries)} are not those written "
                    f"{sorted(on_disk)}"
                )
            manifest = gf.Manifest(iteration, world_size, entries)
            gf.write_durably(tmp / gf.MANIFEST, gf.encode_manifest(manifest))
            for r in range(world_size):
                (tmp / gf.sidecar_name(r)).unlink()
            fsync_dir(tmp)
            target = self.root_dir / gf.iter_dir_name(iteration)
            if target.exists():  # saved again (a rolled-back run): the new one replaces it
                self._remove(target)
            os.rename(tmp, target)
            fsync_dir(self.root_dir)
            self._bad.discard(iteration)
            logger.info("global checkpoint %d is complete: %s", iteration, target)
            self._clean_up(iteration)

    def _clean_up(self, saved: int) -> None:
        """Apply `keep_last`; remove abandoned hidden directories. Errors are only logged."""
        try:
            visible = gf.list_visible(self.root_dir)
            for iteration in gf.retention(visible, saved, self.config.keep_last):
                self._remove(self.root_dir / gf.iter_dir_name(iteration))
            for name in os.listdir(self.root_dir):
                if gf.is_tmp_dir_name(name) or name.startswith(".trash."):
                    self._remove(self.root_dir / name)
        except OSError as e:
            logger.warning("could not remove old global checkpoints: %s", e)

    def _remove(self, path: Path) -> None:
        """Rename to a hidden name first, so a removal cut short leaves nothing visible."""
        if not path.name.startswith(".trash."):
            trash = path.with_name(f".trash.{path.name}.{random.getrandbits(64):016x}")
            os.rename(path, trash)
            path = trash
        shutil.rmtree(path)

    def _agree_token(self) -> int:
        """A random token every rank of the group shares (rank 0's)."""
        token = torch.tensor([random.getrandbits(63)], dtype=torch.int64)
        if self._pg is not None:
            dist.broadcast(token, src=dist.get_global_rank(self._pg, 0), group=self._pg)
        return int(token.item())

    def _rank_and_world_size(self) -> tuple[int, int]:
        if self._pg is None:
            return 0, 1
        return dist.get_rank(self._pg), dist.get_world_size(self._pg)


@contextlib.contextmanager
def _one_line_errors(tmp: Path) -> Iterator[None]:
    """A failed write as a `CheckpointWriteError` of one line naming the path (DCP's own error
    carries every failed rank's traceback in its message)."""
    try:
        yield
    except OSError as e:
        where = e.filename or tmp
        raise CheckpointWriteError(f"global checkpoint {where}: {e.strerror or e}") from e
    except CheckpointException as e:
        rank, failure = next(iter(e.failures.items()))
        cause = failure[0] if isinstance(failure, tuple) else failure
        where = getattr(cause, "filename", None) or tmp
        text = getattr(cause, "strerror", None) or str(cause).splitlines()[0]
        raise CheckpointWriteError(f"global checkpoint {where}: {text} (rank {rank})") from e
