"""Where parts live: the `PartStore` protocol, and `DirectoryStore` (plain files) behind it.

The manager speaks only to a `PartStore`, so a later tier (parts held in the node agent's
memory and replicated to peers) replaces `DirectoryStore` without touching the manager.

`DirectoryStore` layout, under its root (`<root_local_ckpt_dir>/<session_id>`):

    iter_0000420/rank3-of8.ftckpt            a complete part
    iter_0000420/rank3-of8.ftckpt.tmp-4711   being written by process 4711 (or left by a crash)
    iter_0000420/rank3-of8.ftckpt.corrupt    set aside after failing to load; never read again

A part is named by what it holds, the global rank at save time and the world size, not by the
node it happens to be on, so a job restarted with its nodes in another order still finds it.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ftrun.checkpointing import pinning
from ftrun.checkpointing.errors import CheckpointCorruptError, CheckpointWriteError
from ftrun.checkpointing.format import PartInfo, read_info, read_part
from ftrun.checkpointing.part_write import PendingPart, planned, prepare_part
from ftrun.checkpointing.read_into import read_part_into
from ftrun.checkpointing.recycled import RecyclePool

SUFFIX = ".ftckpt"
CORRUPT_SUFFIX = ".corrupt"
_ITERATION_DIR = re.compile(r"iter_(\d{7,})")
_CREATE_ATTEMPTS = 3
"""How many times a part's directory is made again when another rank removed it meanwhile."""
_WARM_SLACK = 1 << 16
"""Bytes a warmed file has beyond the part it was sized for: later headers may be longer."""


@dataclass(frozen=True, order=True)
class PartKey:
    """One rank's part of one iteration; ordered by iteration first."""

    iteration: int
    rank: int
    world_size: int


class PreparedPart(Protocol):
    """A part whose bytes the store owns, not yet visible: `commit` or `abort` it, once."""

    def commit(self) -> PartInfo: ...

    def abort(self) -> None: ...

    def queue_device_copies(self, after: Any = None) -> Any:
        """`defer_copy` only: see `part_write.PendingPart`."""
        ...

    def copy_host_tensors(self) -> None:
        """`defer_copy` only: see `part_write.PendingPart`."""
        ...


class PartStore(Protocol):
    """Storage of parts. Every method is safe to call from one thread at a time per store."""

    def prepare(
        self, key: PartKey, state: Any, metadata: Mapping[str, str], defer_copy: bool = False
    ) -> PreparedPart:
        """Copy `state` into storage the store owns; the caller may then change it. With
        `defer_copy`, nothing is copied until the part's copy methods are called."""
        ...

    def write(self, key: PartKey, state: Any, metadata: Mapping[str, str]) -> PartInfo:
        """`prepare` and `commit` in one call."""
        ...

    def read(self, key: PartKey, verify: bool = True, into: Any = None) -> tuple[Any, PartInfo]:
        """The part's state (read into `into`'s tensors if given: see `read_into`); raises
        `CheckpointNotFoundError` / `CheckpointCorruptError`."""
        ...

    def info(self, key: PartKey) -> PartInfo:
        """The part's header only, validated: the cheap check behind `find_latest`."""
        ...

    def list(self, rank: int, world_size: int, complete_only: bool = True) -> list[PartKey]:
        """This rank's parts, oldest first; with `complete_only=False` also keys of which only
        leftovers (temp or set-aside files, an empty directory) remain, to remove them."""
        ...

    def remove(self, key: PartKey) -> None:
        """Delete the part and its leftovers; a missing part is not an error."""
        ...

    def set_aside(self, key: PartKey) -> None:
        """Keep a bad part for inspection where it will never be read again."""
        ...


class DirectoryStore:
    """Parts as files under `root` (see the module docstring for the layout).

    With `recycle` (node memory under ft_launcher), a removed part's file is not deleted but
    kept out of sight as `.recycled-<part name>.<n>` and written again by a later save of that
    rank, still mapped: the save's copy then costs a memcpy, not a new file's page
    allocation (see `part_write`). A part this process read is never recycled (its readers map it).
    """

    def __init__(self, root: str | Path, recycle: bool = False) -> None:
        self.root = Path(root)
        self._recycled = RecyclePool(self.root) if recycle else None

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.root)!r})"

    def path_of(self, key: PartKey) -> Path:
        name = part_file_name(key.rank, key.world_size)
        return self.root / iteration_dir_name(key.iteration) / name

    def prepare(
        self, key: PartKey, state: Any, metadata: Mapping[str, str], defer_copy: bool = False
    ) -> PreparedPart:
        path = self.path_of(key)
        attempts = _CREATE_ATTEMPTS
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CheckpointWriteError(f"cannot create {path.parent}: {e.strerror or e}") from e
            try:
                return self._prepare_in(path, key, state, metadata, defer_copy)
            except CheckpointWriteError as e:
                # Another rank's retention removed the iteration's directory, empty, between
                # our mkdir and our first file in it (`remove`: the last rank out removes it).
                gone = isinstance(e.__cause__, FileNotFoundError) and not path.parent.is_dir()
                attempts -= 1
                if not gone or attempts == 0:
                    raise

    def _prepare_in(
        self, path: Path, key: PartKey, state: Any, metadata: Mapping[str, str], defer_copy: bool
    ) -> PreparedPart:
        if self._recycled is None:
            return prepare_part(path, state, key.iteration, metadata, defer_copy=defer_copy)
        recycled = self._recycled.take(path.name)
        pending = prepare_part(
            path, state, key.iteration, metadata, recycled, keep_mapping=True, defer_copy=defer_copy
        )
        return _Kept(pending, self._recycled)

    def write(self, key: PartKey, state: Any, metadata: Mapping[str, str]) -> PartInfo:
        return self.prepare(key, state, metadata).commit()

    def warm(self, key: PartKey, state: Any, metadata: Mapping[str, str], count: int) -> None:
        """With `recycle`: `count` files mapped for this rank's next parts like `state`'s,
        ahead of its saves (see `recycled`)."""
        if self._recycled is None:
            return
        flat, layout = planned(state, key.iteration, metadata)
        devices = pinning.cuda_devices(flat.tensors)
        size = layout.total + _WARM_SLACK
        name = part_file_name(key.rank, key.world_size)
        self._recycled.warm(name, size, count, devices[0] if devices else None)

    def read(self, key: PartKey, verify: bool = True, into: Any = None) -> tuple[Any, PartInfo]:
        if into is not None:  # always verified: the check rides along with the one read
            state, info = read_part_into(self.path_of(key), into)
            return state, _check_iteration(key, info)
        if self._recycled is not None:  # views of it stay mapped: never reuse it
            self._recycled.read.add(self.path_of(key))
        state, info = read_part(self.path_of(key), verify=verify)
        return state, _check_iteration(key, info)

    def info(self, key: PartKey) -> PartInfo:
        return _check_iteration(key, read_info(self.path_of(key)))

    def list(self, rank: int, world_size: int, complete_only: bool = True) -> list[PartKey]:
        name = part_file_name(rank, world_size)
        found = []
        for directory in _iteration_dirs(self.root):
            key = PartKey(int(directory.name[len("iter_") :]), rank, world_size)
            if (directory / name).is_file() or (not complete_only and _leftover(directory, name)):
                found.append(key)
        return sorted(found)

    def remove(self, key: PartKey) -> None:
        path = self.path_of(key)
        if not path.parent.is_dir():
            return
        if self._recycled is not None:
            self._recycled.retire(path)
        try:  # the node's agent may remove the same parts (its retention) at the same time
            children = list(path.parent.iterdir())
        except FileNotFoundError:
            return
        for child in children:
            if _belongs(child.name, path.name):
                child.unlink(missing_ok=True)
        try:
            path.parent.rmdir()  # the last rank out removes the iteration's directory
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise

    def set_aside(self, key: PartKey) -> None:
        path = self.path_of(key)
        if path.exists():
            path.replace(path.with_name(path.name + CORRUPT_SUFFIX))


class _Kept:
    """A pending part whose mapping the store keeps once committed (for its later reuse)."""

    def __init__(self, pending: PendingPart, pool: RecyclePool) -> None:
        self._pending = pending
        self._pool = pool

    def commit(self) -> PartInfo:
        info = self._pending.commit()
        if self._pending.kept_mapping is not None:
            self._pool.kept[self._pending.path] = self._pending.kept_mapping
        return info

    def abort(self) -> None:
        self._pending.abort()

    def queue_device_copies(self, after: Any = None) -> Any:
        return self._pending.queue_device_copies(after)

    def copy_host_tensors(self) -> None:
        self._pending.copy_host_tensors()


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def part_file_name(rank: int, world_size: int) -> str:
    return f"rank{rank}-of{world_size}{SUFFIX}"


def _belongs(filename: str, part_name: str) -> bool:
    """The part itself or one of its leftovers (`.tmp-<pid>`, `.corrupt`)."""
    return filename == part_name or filename.startswith(part_name + ".")


def _leftover(directory: Path, part_name: str) -> bool:
    """Files the part left (or an empty directory: a write that failed before its first byte,
    which counts as every rank's leftover, so it is removed by the next clean-up)."""
    children = [child.name for child in directory.iterdir()]
    return not children or any(_belongs(child, part_name) for child in children)


def _iteration_dirs(root: Path) -> list[Path]:
    try:
        children = list(root.iterdir())
    except FileNotFoundError:
        return []
    return [c for c in children if _ITERATION_DIR.fullmatch(c.name) and c.is_dir()]


def _check_iteration(key: PartKey, info: PartInfo) -> PartInfo:
    if info.iteration != key.iteration:
        raise CheckpointCorruptError(
            f"{info.path}: holds iteration {info.iteration}, its name says {key.iteration}"
        )
    return info
