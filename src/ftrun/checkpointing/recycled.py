"""Reusing a retired part's memory: the recycled files of each rank, kept mapped between saves.

A new file in node memory costs far more than the copy into it (tmpfs allocates and zeroes
every page, each faulted into the mapping: ~7x a memcpy; for CUDA tensors it is page-locked
too), so under ft_launcher a part that retention removes is not deleted: it is renamed out of
sight to `.recycled-<part name>.<n>` and the next save of that rank writes into it, still mapped
from when this process wrote it, at memcpy speed. Recycled files left by a rank's previous
process (a worker restart) are taken too, mapped anew. A part this process read is never
reused: its readers map it.

`warm` makes a rank's files ahead of its saves: the first saves of a process would otherwise
each hold the optimizer's step while new memory is made (on this VM a fresh start's first six
steps took ~1 s each instead of 0.15 s; on an H100, a 1.7 GB state's first save 0.7 s).
"""

from __future__ import annotations

import glob
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ftrun.checkpointing import pinning
from ftrun.checkpointing.persist import reserve

RECYCLED_PREFIX = ".recycled-"
KEPT_PER_PART = 3
"""Recycled files kept per rank: a snapshot every step rotates two complete parts and one being
written (`StepSnapshot`'s `keep_complete` + 1)."""


@dataclass
class Recycled:
    """A retired part's file, out of sight, whose memory the next part may reuse."""

    path: Path
    size: int
    mapping: mmap.mmap | None = None
    """Still mapped (shared, pages present) from when this process wrote it; None: map anew."""


def open_recycled(recycled: Recycled, tmp: Path, total: int) -> tuple[int, mmap.mmap | None]:
    """The recycled file, under the temp name, cut to `total` and mapped; (-1, None) when it is
    too small or gone (the caller then writes a new file)."""
    if recycled.size < total:
        recycled.path.unlink(missing_ok=True)
        return -1, None
    try:
        os.replace(recycled.path, tmp)
    except FileNotFoundError:
        return -1, None
    fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
    os.ftruncate(fd, total)  # the mapping may be longer: only its first `total` bytes are used
    mapping = recycled.mapping
    if mapping is None:
        mapping = pinning.Mapping(fd, total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return fd, mapping


@dataclass
class RecyclePool:
    """The recycled files of the parts one store writes under `root`, and what may not be reused."""

    root: Path
    kept: dict[Path, mmap.mmap] = field(default_factory=dict)
    """Parts this process wrote, still mapped."""
    read: set[Path] = field(default_factory=set)
    recycled: dict[str, list[Recycled]] = field(default_factory=dict)
    """Part name (rank, world size) -> its recycled files."""

    def take(self, part_name: str) -> Recycled | None:
        """One of this rank's recycled files: a mapped one, else one a previous process left."""
        if spares := self.recycled.get(part_name):
            return spares.pop()
        return self._left_over(part_name)

    def retire(self, path: Path) -> None:
        """Keep the part's file as one of its rank's recycled files, unless it was read or
        enough are kept: up to a rotation's worth still mapped, else (a previous process's
        part) as the rank's only one, to be mapped when taken."""
        mapping = self.kept.pop(path, None)
        spares = self.recycled.setdefault(path.name, [])
        if mapping is not None:
            enough = len(spares) >= KEPT_PER_PART
        else:
            enough = bool(spares) or self._left_over(path.name) is not None
        if path in self.read or enough:
            _close(mapping)
            return
        recycled = self._free_path(path.name)
        try:
            size = path.stat().st_size
            path.replace(recycled)
        except OSError:  # gone already: nothing to reuse
            _close(mapping)
            return
        if mapping is not None:
            spares.append(Recycled(recycled, size, mapping))

    def warm(self, part_name: str, size: int, count: int, device: torch.device | None) -> None:
        """Have `count` recycled files of at least `size` bytes mapped, page-locked for
        `device` (CUDA), for this rank's next saves: those a previous process left first."""
        spares = self.recycled.setdefault(part_name, [])
        while len(spares) < count:
            left = self._left_over(part_name)
            if left is not None and left.size < size:
                left.path.unlink(missing_ok=True)
                continue
            path = left.path if left is not None else self._free_path(part_name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    reserve(fd, size)
                    mapping = pinning.Mapping(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                finally:
                    os.close(fd)
            except OSError:
                path.unlink(missing_ok=True)
                raise
            if device is not None:
                pinning.pin(mapping, device)
            spares.append(Recycled(path, size, mapping))

    def _left_over(self, part_name: str) -> Recycled | None:
        """A recycled file of this rank's that no entry holds (a previous process's)."""
        held = {spare.path for spare in self.recycled.get(part_name, ())}
        pattern = glob.escape(RECYCLED_PREFIX + part_name) + "*"
        for name in sorted(glob.glob(pattern, root_dir=self.root)):
            path = self.root / name
            if path not in held:
                try:
                    return Recycled(path, path.stat().st_size)
                except OSError:
                    continue
        return None

    def _free_path(self, part_name: str) -> Path:
        index = 0
        while (path := self.root / f"{RECYCLED_PREFIX}{part_name}.{index}").exists():
            index += 1
        return path


def _close(mapping: mmap.mmap | None) -> None:
    if mapping is not None:
        mapping.close()
