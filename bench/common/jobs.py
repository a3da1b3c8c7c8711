"""Shared helpers of the launcher benchmarks: launching jobs, reading worker logs, tables.

A `Job` is 2 local launchers ("nodes") x 2 workers of `bench/worker.py` (or of the user-style
`bench/user_worker.py`, whose step lines `read_steps` parses) on a fresh rendezvous port and a
fresh temporary directory. The bench process makes itself a child subreaper, so a
worker orphaned by a dying launcher re-parents to it and cannot escape the clean-up; every
process of a job also carries `FTRUN_BENCH_TAG` in its environment, which the final psutil check
looks for. All waits are bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import psutil

T = TypeVar("T")
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORKER = BENCH / "worker.py"
USER_WORKER = BENCH / "user_worker.py"
VENV_BIN = ROOT / ".venv" / "bin"
NVRX_BIN = BENCH / ".nvrx-venv" / "bin"
TAG_ENV = "FTRUN_BENCH_TAG"
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC
PR_SET_CHILD_SUBREAPER = 36
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
FT = Launcher("ft_launcher", (str(VENV_BIN / "ft_launcher"),), HB_TIMEOUT_ARGS)
FT_NO_PREWARM = dataclasses.replace(
    FT, name="ft_launcher, no fork server", args=("--ft-prewarm-modules=none",)
)
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


# ---- processes ---------------------------------------------------------------------------------


def become_subreaper() -> None:
    """Orphaned descendants re-parent to this process, so the clean-up can find them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reap_zombies() -> None:
    """Collect exited processes that re-parented to us (we are a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


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
        victims = [p for p in psutil.Process().children(recursive=True) if _alive(p)]
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


# ---- worker logs -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Record:
    kind: str  # start | step | fault
    ts: float
    pid: int = 0


def parse_line(line: str) -> Record | None:
    fields = line.split()
    if not fields or (fields[0] == "step" and len(fields) < 4):
        return None  # a torn or empty line
    with contextlib.suppress(ValueError, IndexError):
        if fields[0] == "start":
            return Record("start", float(fields[1]), int(fields[2]))
        if fields[0] == "step":
            return Record("step", float(fields[3]))
        if fields[0] == "fault":
            return Record("fault", float(fields[2]))
    return None


def read_rank(out: Path, rank: int) -> list[Record]:
    path = out / f"rank{rank}.log"
    if not path.exists():
        return []
    records = (parse_line(line) for line in path.read_text(errors="replace").splitlines())
    return [r for r in records if r is not None]


def first_after(records: Sequence[Record], kind: str, ts: float, start: int = 0) -> int | None:
    """Index of the first `kind` record at or after `start` whose time is after `ts`."""
    for i in range(start, len(records)):
        if records[i].kind == kind and records[i].ts > ts:
            return i
    return None


def fault_time(out: Path) -> float | None:
    faults = [r.ts for rank in range(WORLD) for r in read_rank(out, rank) if r.kind == "fault"]
    return min(faults) if faults else None


def all_stepping(out: Path, since: float) -> float | None:
    """When the last rank made its first step after `since` (after a fresh start)."""
    times = []
    for rank in range(WORLD):
        records = read_rank(out, rank)
        started = first_after(records, "start", since)
        stepped = None if started is None else first_after(records, "step", since, started)
        if stepped is None:
            return None
        times.append(records[stepped].ts)
    return max(times)


def all_started(out: Path, since: float) -> float | None:
    """When the last rank's new process started after `since`."""
    times = []
    for rank in range(WORLD):
        records = read_rank(out, rank)
        started = first_after(records, "start", since)
        if started is None:
            return None
        times.append(records[started].ts)
    return max(times)


def worker_pids(out: Path) -> set[int]:
    return {r.pid for rank in range(WORLD) for r in read_rank(out, rank) if r.kind == "start"}


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

    def describe(self, since: float | None = None) -> str:
        """What the launchers did, for a run that did not reach its goal."""
        codes = ", ".join("running" if c is None else f"exit {c}" for c in self.exit_codes())
        text = f"launchers: {codes}"
        if since is not None:
            starts = [
                sum(r.kind == "start" and r.ts > since for r in read_rank(self.out, rank))
                for rank in range(WORLD)
            ]
            text += f"; worker starts after the fault, per rank: {starts}"
        for node in range(NNODES):
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
    extra: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    script: Path = WORKER,
    launchers: int = NNODES,
) -> Job:
    """Start `launchers` launchers of `script` (`bench/worker.py`) on a fresh port and directory
    (more than NNODES: the others stand by, with `--nnodes=NNODES` in `extra`)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", launcher.name)
    tmp = Path(tempfile.mkdtemp(prefix=f"ftrun-bench-{slug}-"))
    out = tmp / "out"
    extra = [f"--log-dir={tmp / 'logs'}", *launcher.args, *extra]
    port = free_port()
    argv = launcher_argv(launcher, port, tmp.name, extra)
    argv += [str(script), "--out", str(out), *worker_args]
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
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
    return Job(launcher, tmp, out, procs, launched_at, port)


@contextlib.contextmanager
def job(
    launcher: Launcher,
    extra: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    script: Path = WORKER,
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


# ---- user-style worker logs (bench/user_worker.py) ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepLine:
    """A line of `bench/user_worker.py`: a finished step, or (`fault` set) a fault about to fire."""

    ts: float
    rank: int
    pid: int
    step: int
    fault: str | None = None


def parse_step_line(line: str) -> StepLine | None:
    """`<ts> rank=<r> pid=<pid> step=<n> loss=<x>|fault=<kind>`; None for anything else."""
    fields = line.split()
    with contextlib.suppress(ValueError, KeyError, IndexError):
        values = dict(field.split("=", 1) for field in fields[1:] if "=" in field)
        return StepLine(
            float(fields[0]),
            int(values["rank"]),
            int(values["pid"]),
            int(values["step"]),
            values.get("fault"),
        )
    return None


def read_steps(out: Path, rank: int) -> list[StepLine]:
    """A rank's complete lines (a line still being written, without its newline, is left out)."""
    path = out / f"rank{rank}.log"
    if not path.exists():
        return []
    complete = path.read_text(errors="replace").split("\n")[:-1]
    return [r for r in map(parse_step_line, complete) if r is not None]


def user_fault(out: Path) -> StepLine | None:
    """The job's injected fault (the earliest fault line)."""
    faults = [r for rank in range(WORLD) for r in read_steps(out, rank) if r.fault]
    return min(faults, key=lambda r: r.ts, default=None)


def user_pids(out: Path, until: float | None = None) -> set[int]:
    """Processes that logged a line (at or before `until`)."""
    return {
        r.pid
        for rank in range(WORLD)
        for r in read_steps(out, rank)
        if until is None or r.ts <= until
    }


def user_all_stepping(
    out: Path, since: float = 0.0, old_pids: frozenset[int] = frozenset()
) -> float | None:
    """When the last rank finished its first step after `since` in a process not in `old_pids`."""
    times = []
    for rank in range(WORLD):
        first = next(
            (
                r.ts
                for r in read_steps(out, rank)
                if not r.fault and r.ts > since and r.pid not in old_pids
            ),
            None,
        )
        if first is None:
            return None
        times.append(first)
    return max(times)


# ---- fault runs --------------------------------------------------------------------------------

FAULT_WAIT_S = 120.0
RECOVERY_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One fault run: seconds from the fault to all new workers started / all stepping."""

    to_started: float | None
    to_stepping: float | None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.to_stepping is not None


def fault_args(fault: str, fault_step: int, trigger: bool = False) -> list[str]:
    """Worker arguments: `fault` at `fault_step` (0: never), or once the bench calls `trigger`."""
    return ["--fault", fault, "--fault-step", str(fault_step)] + (
        ["--fault-on-trigger"] if trigger else []
    )


def trigger(run: Job) -> None:
    """Ask the job's faulty rank to fault now (workers started with `fault_args(trigger=True)`)."""
    (run.out / "fault.trigger").touch()


def launcher_fault_args(launcher: Launcher, fault: str) -> tuple[str, ...]:
    """The launcher flags a fault scenario needs (the heartbeat timeout for a hang)."""
    return (launcher.hang_args or ()) if fault == "hang" else ()


def await_recovery(run: Job) -> Recovery:
    """Wait for the job's injected fault, then for every rank to step again; time both."""
    fault_ts = run.wait(lambda: fault_time(run.out), FAULT_WAIT_S)
    if fault_ts is None:
        return Recovery(None, None, f"no fault within {FAULT_WAIT_S:.0f}s; {run.describe()}")
    stepping = run.wait(lambda: all_stepping(run.out, fault_ts), RECOVERY_WAIT_S)
    started = _since(all_started(run.out, fault_ts), fault_ts)
    if stepping is None:
        note = f"not all ranks stepping {RECOVERY_WAIT_S:.0f}s after the fault; "
        return Recovery(started, None, note + run.describe(fault_ts))
    return Recovery(started, stepping - fault_ts)


def fault_run(launcher: Launcher, fault: str, fault_step: int) -> Recovery:
    """Inject `fault` once (rank 1 at `fault_step`) and time the recovery."""
    extra = launcher_fault_args(launcher, fault)
    with job(launcher, extra, fault_args(fault, fault_step)) as run:
        return await_recovery(run)


def _since(ts: float | None, origin: float) -> float | None:
    return None if ts is None else ts - origin


# ---- statistics and tables ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stats:
    median: float
    low: float
    high: float
    n: int

    @staticmethod
    def of(values: Sequence[float | None]) -> Stats | None:
        clean = [v for v in values if v is not None]
        if not clean:
            return None
        return Stats(statistics.median(clean), min(clean), max(clean), len(clean))

    def cell(self, fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(self.median)} ({fmt.format(self.low)}-{fmt.format(self.high)})"


def ratio(a: Stats | None, b: Stats | None) -> float | None:
    if a is None or b is None or b.median <= 0:
        return None
    return a.median / b.median


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """A plain aligned table, or a GitHub-markdown one."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*headers), *(fmt.format(*row) for row in rows)])


def load_average() -> str:
    """The 1-minute load average: the machine is shared, so results say how busy it was."""
    return f"{os.getloadavg()[0]:.1f}"


def machine_line(load_before: str) -> str:
    load = f"1-min load average {load_before} at start, {load_average()} at end"
    return f"machine: {os.cpu_count()} cores; {load}"


def progress(message: str) -> None:
    """Progress goes to stderr so stdout stays the table."""
    print(message, file=sys.stderr, flush=True)
