"""Helpers for tests that run slurm/ftrun.sbatch on the local cluster: submit, follow, inspect.

A "chain" is one job as the user sees it: the first Slurm job plus every relaunch of it (new
jobs when resubmitted, the same job id again when requeued). They share one job dir, where
relaunch.py appends a line per run to relaunches.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from launch import prewarm_args
from support import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "ftrun.sbatch"
EXAMPLE = REPO / "examples" / "train_ddp.py"
# examples/train_ddp.py with its --crash only in the first run of a chain (see there).
TRAIN_FIRST_RUN_FAULTS = Path(__file__).with_name("train_first_run_faults.py")
LAUNCHER = Path(sys.executable).with_name("ft_launcher")
STORE_COMMAND = f"{Path(sys.executable).with_name('ftrun')} store"
POLL_S = 0.1
# A job in any other state (PENDING, RUNNING, COMPLETING, REQUEUED, ...) may still run.
ENDED_STATES = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "TIMEOUT"}
)
SBATCH_TIMEOUT_S = 30


def job_env(cluster: Any, **extra: str) -> dict[str, str]:
    """The cluster's client env plus what the template needs here; sbatch exports it all."""
    env = dict(cluster.env)
    env.update(
        FTRUN_LAUNCHER=str(LAUNCHER),
        FTRUN_STORE_COMMAND=STORE_COMMAND,
        FTRUN_PYTHON=sys.executable,
        FTRUN_RDZV_PORT=str(free_port()),
        # Two cores: one thread per worker.
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@dataclass
class Chain:
    """One submitted ftrun job and its relaunches."""

    cluster: Any
    job_dir: Path
    first_job: str

    @property
    def history(self) -> list[dict]:
        path = self.job_dir / "relaunches.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def job_ids(self) -> list[str]:
        """Every Slurm job of the chain so far, in order, without repeats (requeue)."""
        ids = [self.first_job]
        for record in self.history:
            for key in ("job_id", "next_job_id"):
                if record.get(key) and record[key] not in ids:
                    ids.append(record[key])
        return ids

    def wait_stopped(self, timeout: float) -> list[dict]:
        """Wait until a run decided to stop and its Slurm job ended; returns the history."""

        def stopped() -> list[dict] | None:
            history = self.history
            if not history or history[-1]["decision"] != "stop":
                return None
            state = self.cluster.job_info(history[-1]["job_id"]).get("JobState")
            return history if state in ENDED_STATES else None

        try:
            return wait_for(stopped, timeout, f"job chain {self.job_ids()} to stop", POLL_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    def wait_progress(self, rank: int, steps: int, timeout: float) -> None:
        """Wait until rank `rank` logged `steps` steps (in all runs together)."""
        wait_for(
            lambda: len(self.progress(rank)) >= steps,
            timeout,
            f"rank {rank} of job {self.first_job} to log {steps} steps\n{self.describe()}",
            POLL_S,
        )

    def progress(self, rank: int) -> list[tuple[int, int]]:
        """(cycle, step) of every step rank `rank` completed, over all runs (example's file)."""
        path = self.job_dir / "ckpt" / f"progress-rank{rank}.txt"
        if not path.exists():
            return []
        rows = [line.split() for line in path.read_text().splitlines()]
        return [(int(row[0]), int(row[1])) for row in rows if len(row) >= 2]

    def state(self, job_id: str) -> tuple[str, str]:
        info = self.cluster.job_info(job_id)
        return info.get("JobState", "?"), info.get("ExitCode", "?")

    def output(self, job_id: str) -> str:
        path = self.job_dir.parent / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else f"(no {path.name})"

    def describe(self) -> str:
        """History and output tails, for failure messages."""
        lines = [f"job dir {self.job_dir}; history:"]
        lines += [f"  {json.dumps(r, sort_keys=True)}" for r in self.history]
        for job_id in self.job_ids():
            with contextlib.suppress(LookupError, RuntimeError):
                lines.append(f"job {job_id}: {self.state(job_id)}")
            lines += [f"  | {ln}" for ln in self.output(job_id).splitlines()[-25:]]
        # Each launcher's last events: a launcher that was killed has no `exit` among them.
        for path in sorted(self.job_dir.glob("runs/*/logs/events-*.jsonl")):
            tail = [json.loads(ln) for ln in path.read_text().splitlines()[-4:] if ln.strip()]
            names = ", ".join(f"{e.get('event')}@{e.get('ts', 0):.1f}" for e in tail)
            lines.append(f"{path.relative_to(self.job_dir)}: ... {names}")
        return "\n".join(lines)

    def events(self, name: str) -> list[dict]:
        """Events `name` of every launcher of every run of the chain (their --log-dir)."""
        found = []
        for path in sorted(self.job_dir.glob("runs/*/logs/events-*.jsonl")):
            lines = path.read_text().splitlines()
            found += [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if e["event"] == name]

    def launcher_of(self, node: str) -> psutil.Process:
        """The ft_launcher process this chain's first job runs on Slurm node `node`."""
        marks = {f"SLURMD_NODENAME={node}".encode(), f"SLURM_JOB_ID={self.first_job}".encode()}

        def is_launcher(proc: psutil.Process) -> bool:
            argv = proc.info["cmdline"] or []
            # srun and the template's per-task wrapper name the launcher too: not them.
            wrapper = proc.info["name"] in ("srun", "bash", "sh") or "--ft-run-task" in argv
            named = any(part.endswith("ft_launcher") for part in argv[:2])
            return not wrapper and (named or "ftrun.ft_launcher.cli" in argv)

        return wait_for(
            lambda: _topmost(is_launcher, marks),
            30,
            f"the launcher of job {self.first_job} on {node}",
            POLL_S,
        )

    def store_process(self) -> psutil.Process:
        """The `ftrun store` of this chain's first job (its own step on the batch host)."""

        def is_store(proc: psutil.Process) -> bool:
            argv = proc.info["cmdline"] or []
            return argv[2:4] == ["store", "--port"] and argv[1].endswith("ftrun")

        marks = {f"SLURM_JOB_ID={self.first_job}".encode()}
        return wait_for(
            lambda: _topmost(is_store, marks), 30, f"ftrun store of job {self.first_job}", POLL_S
        )

    def leftover_processes(self) -> list[str]:
        """Live processes of any job of the chain, on any node (they all live on this host).

        Job processes carry SLURM_JOB_ID (and FTRUN_JOB_DIR from the template) in their
        environment; slurmstepd names its job in its title ("slurmstepd: [12.0]").
        The environment is read raw: slurmstepd's title overwrites the start of that area.
        """
        ids = self.job_ids()
        conf = f"SLURM_CONF={self.cluster.env['SLURM_CONF']}".encode()  # ids repeat per cluster
        job_vars = {f"SLURM_JOB_ID={job_id}".encode() for job_id in ids}
        job_dir = f"FTRUN_JOB_DIR={self.job_dir}".encode()
        steps = tuple(f"[{job_id}." for job_id in ids)
        found = []
        for proc in psutil.process_iter(["name", "status", "cmdline"]):
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            try:
                env = set(Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            title = " ".join(proc.info["cmdline"] or [])
            step = proc.info["name"] == "slurmstepd" and any(s in title for s in steps)
            if (conf in env and (env & job_vars or step)) or job_dir in env:
                found.append(f"{proc.pid}:{proc.info['name']}")
        return found

    def assert_no_processes_left(self, timeout: float = 20.0) -> None:
        """Every process of every job of the chain is gone (slurmstepd tears down in a moment)."""
        try:
            wait_for(lambda: not self.leftover_processes(), timeout, "job processes to exit", 0.2)
        except AssertionError:
            raise AssertionError(
                f"processes of jobs {self.job_ids()} survive: {self.leftover_processes()}"
            ) from None


def submit_chain(
    cluster: Any,
    tmp_path: Path,
    launcher_args: list[str],
    *,
    sbatch_args: tuple[str, ...] = (),
    template_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Chain:
    """sbatch slurm/ftrun.sbatch on 2 nodes, job dir <tmp_path>/job, checkpoints in job/ckpt.

    The job runs in tmp_path, so every job of the chain writes tmp_path/slurm-<id>.out
    (a resubmitted job keeps the working directory).
    """
    job_dir = tmp_path / "job"
    (job_dir / "ckpt").mkdir(parents=True, exist_ok=True)
    script = next((Path(arg) for arg in launcher_args if arg.endswith(".py")), None)
    if script == TRAIN_FIRST_RUN_FAULTS:  # it runs the example: its workers import what that does
        script = EXAMPLE
    if script is not None:  # the fork server's imports as in tests/launch.py's jobs
        launcher_args = [*prewarm_args(launcher_args, script), *launcher_args]
    argv = [
        "sbatch",
        "--parsable",
        "--nodes=2",
        f"--job-name=ftrun-{tmp_path.name[:40]}",
        *sbatch_args,
        str(TEMPLATE),
        f"--ft-job-dir={job_dir}",
        f"--ft-finished-flag={job_dir / 'ckpt' / 'FINISHED'}",
        *template_args,
        "--nproc-per-node=1",
        *launcher_args,
    ]
    proc = subprocess.run(
        argv,
        env=env or job_env(cluster),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SBATCH_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"{' '.join(argv)} failed: {proc.stderr}"
    job_id = proc.stdout.strip().split(";")[0]
    return Chain(cluster, job_dir, job_id)


def train_args(job_dir: Path, *args: str) -> list[str]:
    return ["--ckpt-dir", str(job_dir / "ckpt"), *args]


def elapsed(since: float) -> float:
    return round(time.monotonic() - since, 1)


def _topmost(
    matches: Callable[[psutil.Process], bool], env_marks: set[bytes]
) -> psutil.Process | None:
    """The one process that `matches` and whose environment holds `env_marks`, but whose parent
    does not: a child the launcher forked (its fork server) has the launcher's command line and
    environment, and once PIDs wrap around it can come before its parent in the process list."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline", "name", "ppid"]):
        if not matches(proc):
            continue
        with contextlib.suppress(OSError):
            if env_marks <= set(Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")):
                found[proc.pid] = proc
    tops = [proc for proc in found.values() if proc.info["ppid"] not in found]
    return tops[0] if len(tops) == 1 else None
