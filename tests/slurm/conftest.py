"""The local multi-node Slurm cluster (slurm/dev-cluster) as a session fixture, plus helpers.

`slurm_cluster` runs up.sh once per session (one slurmctld, slurmd n1..n3 on this host,
a private munged; all state under FTRUN_SLURM_STATE, default /tmp/ftrun-slurm), and
down.sh at the end, then checks that none of those daemons survives. Tests that need it
are skipped, with the reason, when not root or when slurm-wlm/munge cannot be installed.

Every Slurm client must be run with `slurm_cluster.env`: it carries SLURM_CONF pointing at
the generated `<state dir>/slurm.conf` (there is no /etc/slurm/slurm.conf), and has any
SLURM_*/SBATCH_*/SRUN_* variables of an enclosing job removed so that tests are hermetic.
There is no accounting DB (no sacct): final job states come from `scontrol show job`,
which keeps finished jobs for MinJobAge (300 s).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from support import reap_zombies, wait_for

DEV_CLUSTER = Path(__file__).resolve().parents[2] / "slurm" / "dev-cluster"
STATE_DIR = Path(os.environ.get("FTRUN_SLURM_STATE", "/tmp/ftrun-slurm"))
NODES = ("n1", "n2", "n3")
SKIP_RC = 77  # up.sh: "cannot run here" (not root, apt-get failed)
UP_TIMEOUT = 300  # first run installs packages (~10 s when the mirror is reachable)
DOWN_TIMEOUT = 120
POLL_INTERVAL = 0.05
CLIENT_TIMEOUT = 30  # one sbatch/scontrol call; slurmctld answers in milliseconds here

# States after which a job never runs again (unless requeued, which shows as PENDING).
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
DAEMON_NAMES = frozenset({"slurmctld", "slurmscriptd", "slurmd", "slurmstepd", "munged"})
_ENCLOSING_JOB_VARS = re.compile(r"^(SLURM_|SLURMD_|SBATCH_|SALLOC_|SRUN_|SQUEUE_|SINFO_)")
# `Key=value` pairs of `scontrol show ... -o`; a key starts the line or follows a blank.
_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/-]*)=")


def cluster_env(state_dir: Path = STATE_DIR) -> dict[str, str]:
    """os.environ for Slurm clients of the dev cluster: SLURM_CONF set, job variables dropped."""
    env = {k: v for k, v in os.environ.items() if not _ENCLOSING_JOB_VARS.match(k)}
    env["FTRUN_SLURM_STATE"] = str(state_dir)
    env["SLURM_CONF"] = str(state_dir / "slurm.conf")
    return env


def _client(args: list[str], env: dict[str, str] | None, stdin: str | None = None, **kw):
    return subprocess.run(
        args,
        env=cluster_env() if env is None else env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT,
        check=False,
        **kw,
    )


def parse_record(line: str) -> dict[str, str]:
    """One line of `scontrol show <entity> -o` as a dict (values may contain '=', not ' Key=')."""
    keys = list(_KEY.finditer(line))
    record = {}
    for key, nxt in zip(keys, [*keys[1:], None], strict=True):
        end = nxt.start() if nxt else len(line)
        record[key.group(1)] = line[key.end() : end].strip()
    return record


def submit(
    script: str | os.PathLike[str] | None,
    env: dict[str, str] | None = None,
    *sbatch_args: str,
    cwd: str | os.PathLike[str] | None = None,
) -> str:
    """sbatch a job; returns its job id (a string, like $SLURM_JOB_ID).

    `script` is a path (Path, or a str without newline that does not start with "#!"),
    the text of a batch script (sent on stdin), or None with `--wrap` in `sbatch_args`.
    Pass `--output=` (e.g. into tmp_path) or `cwd`: otherwise slurm-<id>.out lands in the
    current directory, which is also the job's working directory.
    """
    args = ["sbatch", "--parsable", *sbatch_args]
    stdin = None
    if isinstance(script, os.PathLike):
        args.append(os.fspath(script))
    elif isinstance(script, str):
        if "\n" in script or script.startswith("#!"):
            stdin = script
        else:
            args.append(script)
    proc = _client(args, env, stdin=stdin, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def job_info(job_id: str | int, env: dict[str, str] | None = None) -> dict[str, str]:
    """`scontrol show job -o` of one job as a dict (JobState, Reason, NodeList, ExitCode, ...).

    Raises LookupError when slurmctld does not know the job (never submitted, or finished
    more than MinJobAge ago) and RuntimeError when scontrol itself fails.
    """
    proc = _client(["scontrol", "show", "job", "-o", str(job_id)], env)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            raise LookupError(f"slurm job {job_id} unknown: {proc.stderr.strip()}")
        raise RuntimeError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
    records = [parse_record(line) for line in proc.stdout.splitlines() if line.strip()]
    for record in records:  # an array job lists all its tasks; prefer the exact id
        if record.get("JobId") == str(job_id):
            return record
    if records:
        return records[0]
    raise LookupError(f"slurm job {job_id}: no record in {proc.stdout!r}")


def wait_job_state(
    job_id: str | int,
    states: str | Iterable[str],
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    *,
    fail_on: Iterable[str] | None = None,
) -> dict[str, str]:
    """Poll `scontrol show job` until the job's JobState is one of `states`; return its info.

    Fails at once if the job reaches a state in `fail_on` (default: any terminal state not
    wanted, so waiting for RUNNING on a job that FAILED does not sit out the timeout), and
    fails naming the last state and reason when `timeout` seconds pass. Pass fail_on=()
    to keep waiting through terminal states.
    """
    wanted = {states} if isinstance(states, str) else set(states)
    stop = TERMINAL_STATES - wanted if fail_on is None else set(fail_on)
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while True:
        try:
            info = job_info(job_id, env)
        except RuntimeError:  # slurmctld busy or restarting: retry until the deadline
            info = {}
        state = info.get("JobState")
        if state in wanted:
            return info
        if state in stop:
            raise AssertionError(
                f"slurm job {job_id} is {state} (Reason={info.get('Reason')}, "
                f"ExitCode={info.get('ExitCode')}) while waiting for {sorted(wanted)}"
            )
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for slurm job {job_id} to be "
                f"{sorted(wanted)}; last JobState={state} Reason={info.get('Reason')}"
            )
        time.sleep(POLL_INTERVAL)


@dataclass(frozen=True)
class SlurmCluster:
    """What the `slurm_cluster` fixture yields; the helpers with `env` filled in."""

    state_dir: Path
    env: dict[str, str]
    nodes: tuple[str, ...] = NODES

    @property
    def conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    def submit(self, script: str | os.PathLike[str] | None, *sbatch_args: str, **kw) -> str:
        return submit(script, self.env, *sbatch_args, **kw)

    def job_info(self, job_id: str | int) -> dict[str, str]:
        return job_info(job_id, self.env)

    def wait_job_state(
        self, job_id: str | int, states: str | Iterable[str], timeout: float = 60.0, **kw
    ) -> dict[str, str]:
        return wait_job_state(job_id, states, timeout, self.env, **kw)

    def cancel_all(self, timeout: float = 10.0) -> None:
        """scancel every job of the cluster and wait until none is pending/running/completing."""
        jobs = self.run("squeue", "-h", "-o", "%A").stdout.split()
        if not jobs:
            return
        self.run("scancel", *jobs, check=False)
        wait_for(
            lambda: not self.run("squeue", "-h", "-o", "%A", check=False).stdout.split(),
            timeout=timeout,
            what=f"slurm jobs {jobs} to end after scancel",
            interval=POLL_INTERVAL,
        )

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (scontrol, squeue, scancel, ...) against this cluster."""
        proc = _client(list(args), self.env)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc


def cluster_processes(state_dir: Path = STATE_DIR) -> list[psutil.Process]:
    """Live Slurm/munge daemons, their reapers and job steps of the cluster in `state_dir`.

    The daemons are recognised by the state dir in their command line (up.sh passes -f and
    --socket paths) or by SLURM_CONF in their environment (slurmstepd, slurmscriptd).
    Zombies do not count: pytest is a subreaper and reaps re-parented daemons only later.
    """
    conf = str(state_dir / "slurm.conf")
    reaper_mark = str(state_dir / "run" / "reaper-")
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(proc.info["cmdline"] or [])
        if reaper_mark in cmdline:  # up.sh's reaper around each daemon
            found.append(proc)
            continue
        if proc.info["name"] not in DAEMON_NAMES:
            continue
        try:
            if str(state_dir) in cmdline or proc.environ().get("SLURM_CONF") == conf:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root on Linux (slurm/dev-cluster/up.sh)")
    env = cluster_env(STATE_DIR)
    up = subprocess.run(
        ["bash", str(DEV_CLUSTER / "up.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=UP_TIMEOUT,
        check=False,
    )
    if up.returncode == SKIP_RC:
        reason = next(
            (ln for ln in reversed(up.stderr.splitlines()) if "SKIP:" in ln), up.stderr.strip()
        )
        pytest.skip(f"local Slurm cluster unavailable: {reason}")
    try:
        if up.returncode != 0:
            pytest.fail(f"slurm/dev-cluster/up.sh failed ({up.returncode}):\n{_tail(up.stderr)}")
        yield SlurmCluster(state_dir=STATE_DIR, env=env)
    finally:
        # Also after a failed up.sh: stop whatever part of the cluster did start.
        down = subprocess.run(
            ["bash", str(DEV_CLUSTER / "down.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=DOWN_TIMEOUT,
            check=False,
        )
        reap_zombies()  # the daemons re-parented to pytest (a subreaper) when they forked
        survivors = [f"{p.pid}:{p.info['name']}" for p in cluster_processes(STATE_DIR)]
        assert down.returncode == 0, f"down.sh failed ({down.returncode}):\n{_tail(down.stderr)}"
        assert not survivors, f"slurm processes survive down.sh: {survivors}"


@pytest.fixture(autouse=True)
def _no_jobs_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that used the cluster, cancel what it left in the queue.

    A job left running would hold nodes (so the next test's job pends and times out) and
    its processes would trip the suite's leftover-process check: that check still fails a
    test whose job processes outlive scancel (e.g. a task that escaped its process group).
    """
    yield
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster").cancel_all()
