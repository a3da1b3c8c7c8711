"""The node's checkpoint directory (`FTRUN_CKPT_DIR`): its lifetime and every file operation on
it. The planning is elsewhere (`holdings`); this module only lists, installs and removes.

Where: a 0700 directory made with `mkdtemp` in `/dev/shm` (node memory), named after the run id
and the agent's pid; if `/dev/shm` is absent or not writable, in the system's temp directory
(a disk, slower, but the keeper still works), and a log line says which. It lives as long as
the agent (worker restarts keep it) and `close` removes it. An agent that was SIGKILLed cannot
remove it, and node memory would stay taken until the node reboots; so the agent holds an
exclusive `flock` on `<dir>/owner.lock` for its lifetime, and every new keeper first removes its
user's directories whose lock it can take (`ftrun.owned_dir`).

Installing a part that came from a peer (a push or a restore fetch): a temp file next to its
place, its full size reserved with `posix_fallocate` (no SIGBUS on a full tmpfs), filled through
a shared mapping straight from the socket, closed, verified as a whole (header, every tensor's
CRC, the skeleton: `read_part`), and only then renamed into place. A part that fails any step
leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import mmap
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from ftrun import owned_dir
from ftrun.checkpointing.errors import CheckpointError
from ftrun.checkpointing.format import TMP_MARK, PartInfo, read_info, read_part
from ftrun.checkpointing.keeper.errors import PartRejectedError
from ftrun.checkpointing.keeper.holdings import Holdings
from ftrun.checkpointing.keeper.names import (
    MAX_SESSIONS,
    iteration_dir_name,
    label,
    parse_iteration_dir,
    parse_part_name,
    part_file_name,
    valid_session,
)
from ftrun.checkpointing.persist import reserve
from ftrun.checkpointing.store import CORRUPT_SUFFIX, PartKey
from ftrun.checkpointing.tier_files import (
    POLICY_FILE,
    PROTECTED_FILE,
    RESTORE_FILE,
    STALL_FILE,
    RestoreDecision,
    TierPolicy,
    read_json,
    write_json_atomically,
)
from ftrun.checkpointing.worker_tier import protected_part
from ftrun.config.rendezvous import run_id_in_file_name

log = logging.getLogger("ftrun.agent")

DEFAULT_BASES = (Path("/dev/shm"),)
DIR_PREFIX = "ftrun-ckpt-"
_WHAT = "checkpoint keeper"
# A directory without its lock file may be one another agent is creating right now.
_UNLOCKED_GRACE_S = 600.0


class NodeTier:
    """The directory under `root`; thread-safe (the replicator, the peer handlers and the
    agent's main thread use it at once)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._seq = itertools.count()
        self._lock = threading.Lock()  # session creation only: files are renamed into place
        self._owner_fd = owned_dir.hold_owner_lock(root, _WHAT)

    @classmethod
    def create(cls, run_id: str, bases: Sequence[Path] = DEFAULT_BASES) -> NodeTier:
        """A new 0700 directory in the first usable base, else in the system temp directory."""
        prefix = f"{DIR_PREFIX}{run_id_in_file_name(run_id)}-{os.getpid()}-"
        for base in bases:
            if base.is_dir() and os.access(base, os.W_OK | os.X_OK):
                remove_abandoned(base)
                try:
                    root = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
                except OSError as exc:
                    log.warning("checkpoint keeper: cannot use %s: %s", base, exc)
                    continue
                log.info("checkpoint keeper: parts in %s", root)
                return cls(root)
        root = Path(tempfile.mkdtemp(prefix=prefix))
        log.warning(
            "checkpoint keeper: %s absent or not writable: parts in %s (the temp directory)",
            " or ".join(map(str, bases)) or "no memory directory",
            root,
        )
        return cls(root)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    # ---- listing -------------------------------------------------------------------------

    def sessions(self) -> list[str]:
        """The session directories (names that are not valid sessions are skipped)."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries if valid_session(e.name) and _real_dir(e))

    def listed(self, session: str) -> list[PartKey]:
        """The session's complete parts by name (directory listings only: cheap to poll)."""
        keys = []
        for iteration, entry in self._entries(session):
            key = parse_part_name(entry.name, iteration)
            if key is not None and entry.is_file(follow_symlinks=False):
                keys.append(key)
        return sorted(keys)

    def take_set_aside(self, session: str) -> list[PartKey]:
        """Parts a worker found corrupt and set aside (`*.corrupt`): removed, to free node
        memory, and returned so that the keeper reports them."""
        found = []
        for iteration, entry in self._entries(session):
            if not entry.name.endswith(CORRUPT_SUFFIX):
                continue
            key = parse_part_name(entry.name[: -len(CORRUPT_SUFFIX)], iteration)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            if key is not None:
                found.append(key)
        return sorted(found)

    def holdings(self) -> Holdings:
        """Every session's complete parts whose header reads back valid, with their sizes."""
        found: dict[str, dict[PartKey, int]] = {}
        for session in self.sessions():
            parts = {}
            for key in self.listed(session):
                try:
                    info = read_info(self.part_path(session, key))
                except CheckpointError as exc:
                    log.warning("checkpoint keeper: not offering %s: %s", label(key), exc)
                    continue
                if info.iteration == key.iteration:
                    parts[key] = info.nbytes
            found[session] = parts
        return found

    def has(self, session: str, key: PartKey) -> bool:
        return self.part_path(session, key).is_file()

    def part_path(self, session: str, key: PartKey) -> Path:
        if not valid_session(session):
            raise PartRejectedError(f"bad session name {session!r:.140}")
        name = part_file_name(key.rank, key.world_size)
        return self.root / session / iteration_dir_name(key.iteration) / name

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    # ---- changing ------------------------------------------------------------------------

    def install(
        self, session: str, key: PartKey, nbytes: int, fill: Callable[[mmap.mmap], None]
    ) -> PartInfo:
        """Receive a part through `fill(mapping of nbytes)`, verify it, rename it into place
        (see the module docstring). Raises `PartRejectedError` if its bytes do not verify,
        `OSError` for the filesystem, and what `fill` raises."""
        path = self._session_dir(session) / iteration_dir_name(key.iteration)
        _make_dir(path)
        path /= part_file_name(key.rank, key.world_size)
        tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}.in{next(self._seq)}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                reserve(fd, nbytes)
                with mmap.mmap(fd, nbytes) as mapping:
                    fill(mapping)
            finally:
                os.close(fd)
            info = _verify(tmp, key, nbytes)
            os.replace(tmp, path)
        except BaseException:
            # The directory stays, even if empty: a worker may be starting a part in it (the
            # manager's clean-up removes empty iteration directories).
            tmp.unlink(missing_ok=True)
            raise
        return info

    def remove(self, session: str, keys: Iterable[PartKey]) -> None:
        """Delete these complete parts (a missing one is not an error)."""
        for key in keys:
            path = self.part_path(session, key)
            path.unlink(missing_ok=True)
            _remove_empty(path.parent)

    def read_policy(self, session: str) -> TierPolicy | None:
        """The session's policy; None when there is none yet. Raises ValueError when it is
        malformed (or unreadable)."""
        try:
            raw = read_json(self.root / session / POLICY_FILE)
        except OSError as exc:
            raise ValueError(f"{POLICY_FILE} unreadable: {exc}") from None
        return None if raw is None else TierPolicy.from_json(raw)

    def clear_restore(self) -> None:
        """Drop every session's decision: a restore that fails halfway leaves none stale."""
        for session in self.sessions():
            (self.root / session / RESTORE_FILE).unlink(missing_ok=True)

    def write_restore(self, session: str, decision: RestoreDecision) -> None:
        write_json_atomically(self._session_dir(session) / RESTORE_FILE, decision.to_json())

    def write_protected(self, session: str, iteration: int, world_size: int) -> None:
        """The iteration no clean-up may remove (see `node_tier`); -1 lifts the protection."""
        path = self._session_dir(session) / PROTECTED_FILE
        if iteration < 0:
            path.unlink(missing_ok=True)
        else:
            write_json_atomically(path, RestoreDecision(iteration, world_size).to_json())

    def read_stall(self, session: str, ranks: Iterable[int]) -> float | None:
        """The longest time the latest save of any of `ranks` blocked training (their
        `STALL_FILE`s); None when none of them wrote one readably."""
        found = []
        for rank in ranks:
            try:
                raw = read_json(self.root / session / STALL_FILE.format(rank=rank))
            except (OSError, ValueError):
                continue
            seconds = raw.get("seconds") if raw else None
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                found.append(float(seconds))
        return max(found) if found else None

    def read_protected(self, session: str) -> tuple[int, int] | None:
        """The protected (iteration, world size), read as the workers read it; None if none
        or unreadable (the replicator then writes it anew)."""
        found = protected_part(self.root / session)
        return None if found is None else (found.iteration, found.world_size)

    # ---- helpers -------------------------------------------------------------------------

    def _session_dir(self, session: str) -> Path:
        """The session's directory, made (0700) if new; at most `MAX_SESSIONS` of them."""
        if not valid_session(session):
            raise PartRejectedError(f"bad session name {session!r:.140}")
        path = self.root / session
        with self._lock:
            if not path.exists() and len(self.sessions()) >= MAX_SESSIONS:
                raise PartRejectedError(f"already {MAX_SESSIONS} sessions: not making {session}")
            _make_dir(path)
        return path

    def _entries(self, session: str) -> Iterator[tuple[int, os.DirEntry[str]]]:
        """The entries of the session's iteration directories, with their iteration."""
        try:
            entries = list(os.scandir(self.root / session))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            iteration = parse_iteration_dir(entry.name)
            if iteration is not None and _real_dir(entry):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    yield from ((iteration, child) for child in os.scandir(entry.path))


def _verify(tmp: Path, key: PartKey, nbytes: int) -> PartInfo:
    """The whole part, read back: header, every CRC, the skeleton; and it is the part named."""
    try:
        state, info = read_part(tmp, verify=True)
    except CheckpointError as exc:
        raise PartRejectedError(f"{label(key)} does not verify: {exc}") from None
    del state  # the tensors map the file: let the mapping go now
    if info.iteration != key.iteration or info.nbytes != nbytes:
        raise PartRejectedError(f"{label(key)}: its header says iteration {info.iteration}")
    return info


def _real_dir(entry: os.DirEntry[str]) -> bool:
    return entry.is_dir(follow_symlinks=False)


def _make_dir(path: Path) -> None:
    """A 0700 directory that is not a symlink (a name in our tree never leads out of it)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise PartRejectedError(f"{path} is not a directory")


def _remove_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            log.debug("checkpoint keeper: cannot remove %s: %s", directory, exc)


def remove_abandoned(base: Path, now: float | None = None) -> list[Path]:
    """Remove this user's keeper directories in `base` whose agent is gone: its owner lock is
    free, or it has none and is older than a grace period. Returns what was removed."""
    return owned_dir.remove_abandoned(
        base, DIR_PREFIX, _WHAT, now, unlocked_grace_s=_UNLOCKED_GRACE_S
    )
