"""torch.compile's caches, kept per job on node-local storage across cycles.

A restarted worker of a compiled model recompiles unless it finds inductor's caches (FX graphs,
AOTAutograd) and triton's kernels. Their defaults are /tmp/torchinductor_<user> and
~/.triton/cache: the second often sits on a shared home file system, and both mix every job of
the user. So, unless the user set them, workers get `TORCHINDUCTOR_CACHE_DIR` and
`TRITON_CACHE_DIR` under one 0700 directory per job and user in the node's temporary directory
(`$TMPDIR`, which Slurm sites point at node-local disk), named after the rendezvous id: the
cycles of one job, and a requeued job with the same id, share it. It is kept after the job,
as torch keeps its own.

Inductor's caches hold code that the workers load and run, so a directory that is not this
user's own and private (someone else's, a symlink, group- or world-accessible) is not used: the
launcher says so once and leaves the variables unset.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ftrun.config import LaunchConfig
from ftrun.rendezvous.config import run_id_in_file_name

log = logging.getLogger("ftrun.agent")

CACHE_VARIABLES: Mapping[str, str] = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
}
"""Variable -> its subdirectory of the job's cache directory."""


class UnsafeCacheDir(OSError):
    """The job's cache directory exists but is not this user's private directory."""


def prepare_compile_caches(config: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The cache variables the workers get (those the user did not set), their directories made."""
    missing = [name for name in CACHE_VARIABLES if not environ.get(name)]
    if not missing:
        return {}
    root = job_cache_dir(config.rendezvous.run_id, environ)
    try:
        _private_dir(root)
        for name in missing:
            _private_dir(root / CACHE_VARIABLES[name])
    except OSError as exc:
        log.warning("torch.compile caches left at torch's defaults: %s", exc)
        return {}
    return {name: str(root / CACHE_VARIABLES[name]) for name in missing}


def job_cache_dir(run_id: str, environ: Mapping[str, str]) -> Path:
    """`$TMPDIR/ftrun-compile-<uid>-<run id>` (the run id made safe for a file name)."""
    base = environ.get("TMPDIR") or tempfile.gettempdir()
    safe_id = run_id_in_file_name(run_id) or "none"
    return Path(base) / f"ftrun-compile-{os.getuid()}-{safe_id}"


def _private_dir(path: Path) -> None:
    """Make `path` (mode 0700), or accept it if it is already this user's private directory."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheDir(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise UnsafeCacheDir(f"{path} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & 0o077:
        raise UnsafeCacheDir(f"{path} is open to other users (mode {info.st_mode & 0o777:o})")
