"""Shared test helpers: waiting on conditions with deadlines, and process bookkeeping."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import psutil

from ftrun import identity

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


def free_port() -> int:
    """A TCP port nobody uses now, nor the two after it, for a test's server to listen on later
    (outside the ephemeral range: see `ftrun.identity.free_port`)."""
    return identity.free_port()


def python_cmd(script: str, *args: str) -> list[str]:
    return [sys.executable, "-u", str(WORKERS / script), *args]


def run_dumping_stacks(
    cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a session of its own, bounded.
    Past `timeout`, its descendants that have no children (the workers, which register
    `faulthandler` on SIGUSR1) dump their stacks, then it and every descendant are killed and
    the test fails with the output's tail: a hang says where it hung."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    root = psutil.Process(proc.pid)  # our child: its pid stays its own until we reap it
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, out)
    except subprocess.TimeoutExpired:
        tree = root.children(recursive=True)
        for leaf in tree:
            with contextlib.suppress(psutil.Error):
                if not leaf.children():
                    leaf.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        # All of them by pid: torchrun's workers have sessions of their own.
        for member in (root, *tree):
            with contextlib.suppress(psutil.Error):
                member.kill()
        out, _ = proc.communicate(timeout=30)
        stacks = out[-6000:]
        raise AssertionError(f"still running after {timeout}s; its stacks:\n{stacks}") from None


# `run_gloo_ranks`' parent: imports torch once, then forks each rank (as ftrun's fork server
# forks workers), which runs the script as `python -c` would, as __main__, its stdout and stderr
# in files of its own. Prints each rank's exit code (JSON) once every rank has ended.
_FORK_RANKS = r"""
import importlib, json, os, sys
_ranks, _out, _script = int(sys.argv[1]), sys.argv[2], sys.argv[3]
for _module in sys.argv[4].split(","):
    importlib.import_module(_module)
_code = compile(_script, "<string>", "exec")
sys.argv = ["-c", *sys.argv[5:]]
_pids = {}
for _rank in range(_ranks):
    _pid = os.fork()
    if _pid == 0:
        os.environ["RANK"] = str(_rank)
        for _fd, _name in ((1, "out"), (2, "err")):
            _file = os.open(os.path.join(_out, f"{_name}{_rank}"), os.O_WRONLY | os.O_CREAT)
            os.dup2(_file, _fd)
            os.close(_file)
        exec(_code, sys.modules["__main__"].__dict__)
        sys.exit(0)
    _pids[_pid] = _rank
_codes = {}
while _pids:
    _pid, _status = os.wait()
    _codes[_pids.pop(_pid)] = os.waitstatus_to_exitcode(_status)
print(json.dumps(_codes))
"""


def run_gloo_ranks(
    script: str,
    args: Sequence[str],
    timeout: float,
    ranks: int = 2,
    preload: Sequence[str] = ("torch.distributed",),
) -> list[str]:
    """Run `python -c script *args` as `ranks` torch.distributed ranks on 127.0.0.1 (env://);
    every one must exit 0. Returns each rank's last stdout line; no process outlives the call.
    The ranks are forked from one process that imported `preload` (torch's import once, not
    once a rank: about 1.6 CPU-s each)."""
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gloo-ranks-") as out:
        cmd = [sys.executable, "-c", _FORK_RANKS, str(ranks), out, script, ",".join(preload),
               *args]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            codes, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:  # the ranks are in its process group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        assert proc.returncode == 0, f"the ranks' parent exited {proc.returncode}"
        outputs = [
            (Path(out, f"out{rank}").read_text(), Path(out, f"err{rank}").read_text())
            for rank in range(ranks)
        ]
    exits = json.loads(codes)
    for rank, (_, err) in enumerate(outputs):
        assert exits[str(rank)] == 0, err[-2000:]
    return [out.strip().splitlines()[-1] for out, _ in outputs]
