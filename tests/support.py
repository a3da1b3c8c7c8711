"""Shared test helpers: waiting on conditions with deadlines, and process bookkeeping."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

T = TypeVar("T")
WORKERS = Path(__file__).parent / "workers"
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants of tests re-parent to pytest, so leftovers cannot hide."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """Poll `predicate` until truthy; fail the test naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def live_descendants() -> list[psutil.Process]:
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def reap_zombies() -> None:
    """Collect exited children that re-parented to us (we are a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def python_cmd(script: str, *args: str) -> list[str]:
    return [sys.executable, "-u", str(WORKERS / script), *args]
