"""Reusing a retired part's memory: the recycled file of each rank, kept mapped between saves.

A new file in node memory costs far more than the copy into it (tmpfs allocates and zeroes
every page, each faulted into the mapping: ~7x a memcpy), so under ft_launcher a part that
retention removes is not deleted: it is renamed out of sight to `.recycled-<part name>` (one per
rank) and the next save of that rank writes into it, still mapped from when this process
wrote it, at memcpy speed. Recycled files left by a rank's previous process (a worker restart)
are taken too, mapped anew. A part this process read is never reused: its readers map it.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from ftrun.checkpointing import pinning

RECYCLED_PREFIX = ".recycled-"


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
    recycled: dict[str, Recycled] = field(default_factory=dict)
    """Part name (rank, world size) -> its recycled file."""

    def take(self, part_name: str) -> Recycled | None:
        """This rank's recycled file: the one retired here, else one a previous process left."""
        if (recycled := self.recycled.pop(part_name, None)) is not None:
            return recycled
        path = self.root / f"{RECYCLED_PREFIX}{part_name}"
        try:
            return Recycled(path, path.stat().st_size)
        except OSError:
            return None

    def retire(self, path: Path) -> None:
        """Keep the part's file as its rank's recycled file, unless it was read or one exists."""
        mapping = self.kept.pop(path, None)
        if path in self.read or path.name in self.recycled:
            _close(mapping)
            return
        recycled = self.root / f"{RECYCLED_PREFIX}{path.name}"
        try:
            size = path.stat().st_size
            path.replace(recycled)
        except OSError:  # gone already: nothing to reuse
            _close(mapping)
            return
        self.recycled[path.name] = Recycled(recycled, size, mapping)


def _close(mapping: mmap.mmap | None) -> None:
    if mapping is not None:
        mapping.close()
