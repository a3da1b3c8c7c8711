"""A directory that one process owns while it lives, and that the next one of the same user
removes once its owner is gone.

A process killed with SIGKILL cannot remove what it made: the agent's per-job IPC directory in
the temp directory (`agent.runtime.make_job_dir`), the checkpoint keeper's parts in node memory
(`checkpointing.keeper.node_tier`). So the owner holds an exclusive `flock` on `<dir>/owner.lock`
for its lifetime (the kernel drops it when the process dies, also where containers share the
directory but not their processes), and whoever makes a new one first removes this user's
directories of the same prefix whose lock it can take.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import time
from pathlib import Path

log = logging.getLogger("ftrun.agent")

OWNER_LOCK = "owner.lock"


def hold_owner_lock(root: Path, what: str) -> int | None:
    """Lock `root/owner.lock` for this process's lifetime: the descriptor to keep open (closing
    it gives the directory up), None if the filesystem refuses (`what` says so in the log)."""
    try:
        fd = os.open(
            root / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError as exc:
        log.warning("%s: no owner lock in %s: %s", what, root, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        log.warning("%s: cannot lock %s: %s", what, root / OWNER_LOCK, exc)
        return None
    return fd


def remove_abandoned(
    base: Path,
    prefix: str,
    what: str,
    now: float | None = None,
    min_age_s: float = 0.0,
    unlocked_grace_s: float | None = None,
) -> list[Path]:
    """Remove this user's directories `prefix*` in `base` whose owner is gone: older than
    `min_age_s` and their owner lock free, or without a lock and older than `unlocked_grace_s`
    (None: such a directory is not judged). Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    now = time.time() if now is None else now
    for entry in entries:
        if entry.name.startswith(prefix) and _abandoned(entry, now, min_age_s, unlocked_grace_s):
            shutil.rmtree(entry.path, ignore_errors=True)
            log.warning("%s: removed %s, left by an agent that died", what, entry.path)
            removed.append(Path(entry.path))
    return removed


def _abandoned(
    entry: os.DirEntry[str], now: float, min_age_s: float, unlocked_grace_s: float | None
) -> bool:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    age = now - st.st_mtime
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or age < min_age_s:
        return False
    try:
        fd = os.open(Path(entry.path) / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # one being made right now has no lock yet
        return unlocked_grace_s is not None and age > unlocked_grace_s
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its owner is alive
    finally:
        os.close(fd)  # also releases the lock just taken
    return True


def replace_file(path: Path, data: str | bytes) -> None:
    """Write `path` whole or not at all: a temp file of this process beside it, then a rename
    (readers see the old file or the new one, never half of one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
