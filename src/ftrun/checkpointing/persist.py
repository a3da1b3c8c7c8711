"""The copy on disk under ft_launcher: each part the agent keeps in node memory is also written
under `root_local_ckpt_dir`, where NVRx writes its local checkpoints and where its users look.

The copy is part of the save (NVRx's contract: a save that returned, or an async request that
finished, is on disk): a synchronous save returns after it, an async one does it in its
background thread. Same layout as under plain torchrun (`store.DirectoryStore`), and the same
retention; kernel-side `sendfile` from the node-memory file, fsync, then rename, so a reader
never sees half a part.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ftrun.checkpointing.errors import CheckpointWriteError
from ftrun.checkpointing.format import TMP_MARK


def copy_part(source: Path, path: Path) -> None:
    """Copy the complete part `source` to `path`, durable; `CheckpointWriteError` if it fails."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointWriteError(f"cannot read {source}: {e.strerror or e}") from e
    try:
        copy_into_place(fd, os.fstat(fd).st_size, path)
    except OSError as e:
        raise CheckpointWriteError(f"cannot copy the part to {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def copy_into_place(fd: int, nbytes: int, path: Path) -> None:
    """Copy the open part to `path` (kernel-side `sendfile`), durable, via temp and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}.copy")
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        offset = 0
        while offset < nbytes:
            sent = os.sendfile(out, fd, offset, nbytes - offset)
            if sent == 0:
                raise OSError(f"the part ended after {offset} of {nbytes} bytes")
            offset += sent
        os.fsync(out)
        os.close(out)
        out = -1
        os.replace(tmp, path)
    except BaseException:
        if out >= 0:
            os.close(out)
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make the names in `directory` (a rename into it) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reserve(fd: int, size: int) -> None:
    """Give the file `size` bytes of real blocks up front (`part_write`'s docstring says why:
    no SIGBUS through a mapping on a full tmpfs)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem that cannot: fall back
            raise
        os.ftruncate(fd, size)
