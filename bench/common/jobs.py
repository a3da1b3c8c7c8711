"""The launchers and one job of them: started, waited on, killed and checked gone.

A `Job` is 2 local launchers ("nodes") x 2 workers of a script (`bench/workers/`) on a fresh
rendezvous port and a fresh temporary directory. The bench process makes itself a child subreaper,
so a worker orphaned by a dying launcher re-parents to it and cannot escape the clean-up; every
process of a job also carries `FTRUN_BENCH_TAG` in its environment, which the final psutil check
looks for. All waits are bounded. The process bookkeeping is the tests' (tests/support.py,
tests/launch.py), through `harness`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import psutil

from . import BENCH, ROOT, WORKERS, exit_on_sigterm
from .harness import become_subreaper, free_port, live_descendants, reap_zombies
from .timing import seconds

T = TypeVar("T")
USER_WORKER = WORKERS / "user_worker.py"
VENV_BIN = ROOT / ".venv" / "bin"
NVRX_BIN = BENCH / ".nvrx-venv" / "bin"
TAG_ENV = "FTRUN_BENCH_TAG"
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC
ERROR_PATTERN = re.compile(r"Error|error:|failed|Traceback")


@dataclasses.dataclass(frozen=True)
class Launcher:
    """A launcher command and setting; `hang_args` turn on its heartbeat timeout (None: no hang
    detection); `args` and `env` are this setting's extra flags and environment."""

    name: str
    argv: tuple[str, ...]
    hang_args: tuple[str, ...] | None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def available(self) -> bool:
        return Path(self.argv[0]).exists()


HB_TIMEOUT_ARGS = ("--ft-rank-heartbeat-timeout=2",)
# NVRx refuses sections it was not told of; ft_launcher gets the same flag, for the same script.
SECTION_ARGS = ("--ft-rank-section-timeouts=step:60",)
FT = Launcher("ft_launcher", (str(VENV_BIN / "ft_launcher"),), HB_TIMEOUT_ARGS)
TORCHRUN = Launcher("torchrun", (str(VENV_BIN / "torchrun"),), None)
# torch 2.13's c10d rendezvous shares one TCPStore with the workers across restarts, and the
# workers' keys are not scoped per restart: after a restart gloo reads the dead workers'
# addresses and fails ("Connection refused"), every attempt. Opting out of the sharing is
# torch's own switch (pytorch/pytorch#135712).
TORCHRUN_NO_SHARE = dataclasses.replace(
    TORCHRUN,
    name="torchrun, no shared store",
    env=(("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),),
)
NVRX = Launcher("nvrx", (str(NVRX_BIN / "ft_launcher"),), HB_TIMEOUT_ARGS)


def import_torch_s() -> float:
    """Wall time of a fresh `python -c "import torch"`: what any cold restart pays at least."""
    argv = [str(VENV_BIN / "python"), "-c", "import torch"]
    return seconds(lambda: subprocess.run(argv, check=True))


# ---- processes ---------------------------------------------------------------------------------


def take_charge() -> None:
    """Before the first job: orphaned descendants re-parent to this process, so the clean-up can
    find them, and SIGTERM unwinds through the clean-up as Ctrl-C does (no launcher is left
    running when the bench itself is stopped)."""
    become_subreaper()
    exit_on_sigterm()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes anywhere on the machine whose environment carries this job's tag."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(TAG_ENV) == tag and _alive(proc):
                found.append(proc)
    return found


def _kill(proc: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error, OSError):
        pgid = os.getpgid(proc.pid)
        if pgid != os.getpgid(0):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(psutil.Error):
        proc.kill()


def kill_everything(tag: str, attempts: int = 5) -> None:
    """SIGKILL our descendants and the tagged processes (their groups too); check none is left."""
    for _ in range(attempts):
        victims = live_descendants()
        victims += [p for p in tagged(tag) if p.pid not in {v.pid for v in victims}]
        if not victims:
            return
        for proc in victims:
            _kill(proc)
        psutil.wait_procs(victims, timeout=5)
        reap_zombies()
    left = [f"{p.pid} {p.cmdline()}" for p in tagged(tag)]
    if left:
        raise RuntimeError(f"processes of bench job {tag} survived SIGKILL: {left}")


# ---- one job -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """The launchers of one benchmark job and where their output goes."""

    launcher: Launcher
    tmp: Path
    out: Path
    procs: list[subprocess.Popen[bytes]]
    launched_at: float
    port: int = 0
    """The rendezvous endpoint's port (on 127.0.0.1)."""
    keep: bool = False  # keep the directory after the clean-up (a run worth a look)

    @property
    def tag(self) -> str:
        return str(self.tmp)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def log_tail(self, node: int, lines: int = 8) -> str:
        path = self.tmp / f"launcher{node}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait(self, predicate: Callable[[], T | None], timeout: float) -> T | None:
        """Poll until `predicate` gives a value, every launcher exited, or the deadline."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value is not None:
                return value
            if not self.running():
                return predicate()
            time.sleep(0.05)
        return None

    def describe(self, workers: str = "") -> str:
        """What the launchers did (and `workers`, what the bench saw of the workers), for a run
        that did not reach its goal."""
        codes = ", ".join("running" if c is None else f"exit {c}" for c in self.exit_codes())
        text = f"launchers: {codes}" + (f"; {workers}" if workers else "")
        for node in range(len(self.procs)):
            text += f"\n--- launcher{node}, last error lines:\n{self.error_lines(node)}"
        return text

    def error_lines(self, node: int, count: int = 3) -> str:
        path = self.tmp / f"launcher{node}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        found = [line[:400] for line in lines if ERROR_PATTERN.search(line)]
        return "\n".join(found[-count:]) or self.log_tail(node)


def launcher_argv(launcher: Launcher, port: int, run_id: str, extra: Sequence[str]) -> list[str]:
    return [
        *launcher.argv,
        f"--nnodes={NNODES}",
        f"--nproc-per-node={NPROC}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--max-restarts=3",
        *extra,
    ]


def start_job(
    launcher: Launcher,
    extra: Sequence[str],
    worker_args: Sequence[str],
    script: Path | str,
    launchers: int = NNODES,
) -> Job:
    """Start `launchers` launchers of `script` on a fresh port and directory (more than NNODES:
    the others stand by, with `--nnodes=NNODES` in `extra`). `script`: a file, or (a `str`) a
    module of this repository, run with `--module` from its root (a bench that is its own
    worker: its imports are `bench.`'s)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", launcher.name)
    tmp = Path(tempfile.mkdtemp(prefix=f"ftrun-bench-{slug}-"))
    out = tmp / "out"
    extra = [f"--log-dir={tmp / 'logs'}", *launcher.args, *extra]
    port = free_port()
    argv = launcher_argv(launcher, port, tmp.name, extra)
    module = isinstance(script, str)
    argv += [*(["--module"] if module else []), str(script), "--out", str(out), *worker_args]
    (tmp / "tmp").mkdir()
    env = {**os.environ, **dict(launcher.env), TAG_ENV: str(tmp), "PYTHONUNBUFFERED": "1"}
    env["TMPDIR"] = str(tmp / "tmp")  # what a killed launcher leaves in /tmp goes with the run
    env.pop("VIRTUAL_ENV", None)
    procs = []
    launched_at = time.time()
    for node in range(launchers):
        with (tmp / f"launcher{node}.log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=ROOT if module else None,
                    start_new_session=True,
                )
            )
    return Job(launcher, tmp, out, procs, launched_at, port)


@contextlib.contextmanager
def job(
    launcher: Launcher,
    extra: Sequence[str],
    worker_args: Sequence[str],
    script: Path | str,
    launchers: int = NNODES,
) -> Iterator[Job]:
    """A started job; on exit everything it started is killed and checked gone.

    Its directory is removed unless the job raised, its `keep` was set or `BENCH_KEEP` is set in
    the environment."""
    started = start_job(launcher, extra, worker_args, script, launchers)
    failed = True
    try:
        yield started
        failed = False
    finally:
        kill_everything(started.tag)
        if not (failed or started.keep or os.environ.get("BENCH_KEEP")):
            shutil.rmtree(started.tmp, ignore_errors=True)
