"""torch.compile's caches: where torch keeps them for the user, across cycles and across jobs.

A restarted worker of a compiled model recompiles unless it finds inductor's caches (FX graphs,
AOTAutograd, and triton's kernels, which torch keeps under the same directory, one folder per
device). So does the user's next job. torch's own default, `$TMPDIR/torchinductor_<user>`, is
where torchrun's workers find them, so ftrun's workers use it too: the cycles of a job, the next
job and a torchrun job on the same node share one cache (Slurm sites point `$TMPDIR` at
node-local disk), and no directory is made per job.

Inductor's caches hold code that the workers load and run, so the launcher first checks that
the directory is this user's own and that nobody else can write to it (torch makes it with the
umask's mode, usually 0755, and does not look at who owns an existing one): a symlink, another
user's directory, or one that group or others can write is not used. The workers then get a
private fallback, `$TMPDIR/ftrun-compile-<uid>` (0700), with one warning; if that is unusable
too, caching is turned off for the job (`TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`). A user's own
`TORCHINDUCTOR_CACHE_DIR` is left alone.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("ftrun.agent")

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
DISABLE_VARIABLE = "TORCHINDUCTOR_FORCE_DISABLE_CACHES"


class UnsafeCacheDir(OSError):
    """A cache directory that is not this user's, or that others can write to."""


def prepare_compile_caches(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the workers get on top of `environ` (none when torch's default is safe)."""
    if environ.get(CACHE_VARIABLE):
        return {}
    default = torch_default_cache_dir(environ)
    try:
        _safe_dir(default)
        return {}
    except OSError as exc:
        unsafe = exc
    fallback = private_cache_dir(environ)
    try:
        _safe_dir(fallback)
    except OSError as exc:
        log.warning("torch.compile caches turned off: %s; and %s", unsafe, exc)
        return {DISABLE_VARIABLE: "1"}
    log.warning("torch.compile caches in %s: %s", fallback, unsafe)
    return {CACHE_VARIABLE: str(fallback)}


def torch_default_cache_dir(environ: Mapping[str, str]) -> Path:
    """`torch._inductor.runtime.cache_dir_utils.default_cache_dir()` for the workers' `environ`
    (a test holds the two together)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return _temp_dir(environ) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def private_cache_dir(environ: Mapping[str, str]) -> Path:
    """`$TMPDIR/ftrun-compile-<uid>`: the fallback, one per user (not per job)."""
    return _temp_dir(environ) / f"ftrun-compile-{os.getuid()}"


def _temp_dir(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("TMPDIR") or tempfile.gettempdir())


def _safe_dir(path: Path) -> None:
    """Make `path` (mode 0700), or accept it if it is this user's and only this user can write
    to it."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheDir(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise UnsafeCacheDir(f"{path} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & 0o022:
        raise UnsafeCacheDir(f"others can write to {path} (mode {info.st_mode & 0o777:o})")
