"""The launcher's per-job IPC directory: 0700, held by a lock while its launcher lives, and
removed by the next launcher once its own is gone (a SIGKILLed launcher cannot remove it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ftrun.agent.loop.runtime import make_job_dir


def aged(path: Path) -> Path:
    os.utime(path, (0, 0))  # older than any start-up race
    return path


def test_a_gone_launchers_directory_is_removed_and_a_living_ones_kept(tmp_path: Path):
    living, lock = make_job_dir(tmp_path)
    gone, gone_lock = make_job_dir(tmp_path)
    os.close(gone_lock)  # its launcher was killed: the kernel dropped the lock
    starting, starting_lock = make_job_dir(tmp_path)
    os.close(starting_lock)  # not locked yet, but young: it may be a launcher starting
    foreign = tmp_path / "ftrun-job-oldformat"
    foreign.mkdir()  # no lock file: not this release's, left alone
    for path in (living, gone, foreign):
        aged(path)
    mine, mine_lock = make_job_dir(tmp_path)
    assert living.exists() and starting.exists() and foreign.exists()
    assert not gone.exists()
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    for fd in (lock, mine_lock):
        os.close(fd)
