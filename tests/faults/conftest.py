"""The fault matrix's shared parts: the `fault` fixture, job helpers and the outcome report.

Every case takes the `fault` fixture (a `Fault`): it starts jobs in the case's tmp dir, checks
the documented outcome, and records the case's time and the pids it saw. At teardown the
recorded pids must be gone (the suite-wide fixture in tests/conftest.py then checks that no
process at all is left).

FTRUN_FAULTS_BACKEND (c10d, the default, etcd or store) picks the rendezvous store of every
launcher the matrix starts. On c10d the first agent serves a TCPStore (tests/launch.py's
`start_job`); on etcd one 3-member etcd cluster on 127.0.0.1 (tests/etcd_cluster.py) serves
every case of the pytest session, each job under its own --rdzv-id, and is stopped at the
session's end; on store one `ftrun store` does (tests/store_process.py: c10d with no agent
serving it, `--ft-store-reconnect-timeout`). The
launchers get `Fault.rdzv_args` after the shared ones and before the case's own (later flags
win). A case whose documented outcome depends on where the store lives reads `fault.backend`,
or is marked `@pytest.mark.backends("c10d", reason=...)` and skipped on the other one.

With FTRUN_FAULTS_REPORT=<file>, one JSON line per case is appended to that file: `case` (the
test id), `backend`, `outcome` (passed, failed, error, xfailed, skipped), `expect` (the
documented outcome, e.g. "recovered" or "exit 1"; for a skipped case, why), `seconds` (see
`Fault.time`), `what` (what `seconds` measures), `stepping` (recovered cases: detection ->
every rank stepping again) and `wall` (the whole case). `run_matrix.py` aggregates these over
repeated runs. Cases marked `matrix_only` run only then (`make faults`); `make test` skips them
and names the tests that check the same there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from launch import ROOT, Job, start_job
from store_process import StoreProcess
from support import wait_for

FAULT_WORKER = ROOT / "tests" / "workers" / "fault_worker.py"
# Light (torch-free) cases: heartbeat 1 s, stop timeout 1 s, spares that import only the client.
LIGHT_ARGS = (
    "--max-restarts=2",
    "--workers-stop-timeout=1",
    "--ft-rank-heartbeat-timeout=1",
    "--ft-prewarm-modules=ftrun.client_lib",
)
# Cycle 0 is long enough that the healthy rank is still running when a fault is detected;
# the cycle after a restart is short.
LIGHT_STEPS = ("--steps", "15", "--first-cycle-steps", "250")
REPORT_ENV = "FTRUN_FAULTS_REPORT"
BACKEND_ENV = "FTRUN_FAULTS_BACKEND"
BACKENDS = ("c10d", "etcd", "store")
BACKEND = os.environ.get(BACKEND_ENV) or "c10d"
"""The rendezvous backend of this session's launchers (checked in `pytest_configure`)."""


def matrix_only(covered_by: str) -> pytest.MarkDecorator:
    """A case that only the matrix (`make faults`) runs, which also measures it: in `make test`
    what it would check is `covered_by` already (2 cores: each job is minutes of the suite)."""
    return pytest.mark.skipif(
        not os.environ.get(REPORT_ENV), reason=f"make faults runs it ({covered_by})"
    )


@dataclasses.dataclass
class Fault:
    """One case of the matrix: its jobs, its documented outcome and its measured time."""

    tmp: Path
    backend: str = "c10d"
    rdzv_args: tuple[str, ...] = ()
    """Launcher flags that put the job's store on `backend` (none on c10d: `start_job`'s)."""
    expect: str = ""
    seconds: float | None = None
    what: str = ""
    stepping: float | None = None
    """Recovered cases: detection -> every rank has made a step in the new cycle."""
    pids: set[int] = dataclasses.field(default_factory=set)
    jobs: list[Job] = dataclasses.field(default_factory=list)

    # ---- starting ----------------------------------------------------------------------

    def light(
        self,
        script_args: Sequence[str],
        launcher_args: Sequence[str] = (),
        steps: Sequence[str] = LIGHT_STEPS,
        nodes: int = 2,
        **kw: Any,
    ) -> Job:
        """2 nodes x 1 torch-free `fault_worker.py` rank (`kw`: `start_job`'s)."""
        args = [*LIGHT_ARGS, *launcher_args]
        return self.start(nodes, args, [*steps, *script_args], script=FAULT_WORKER, **kw)

    def start(self, nodes: int, launcher_args: Sequence[str], script_args: Sequence[str], **kw):
        args = [*self.rdzv_args, *launcher_args]  # after start_job's c10d flags, before the case's
        job = start_job(self.tmp, nodes, args, script_args, **kw)
        self.jobs.append(job)
        return job

    def run_launcher(self, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run one launcher in the foreground (output captured); its run time is recorded."""
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "ftrun.ft_launcher.cli", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )
        self.time(time.monotonic() - started, "launcher start to exit")
        return done

    # ---- outcomes ----------------------------------------------------------------------

    def time(self, seconds: float, what: str) -> None:
        self.seconds, self.what = round(seconds, 3), what

    def recovered(self, job: Job, timeout: float = 90, cycles: int = 2) -> list[dict]:
        """All launchers exit 0, every rank finished in the last cycle, the failure of cycle 0
        was handled by a restart; records detection -> all workers running again.

        Returns the failure events (worker_exited with a non-zero code, and hangs) of cycle 0.
        """
        self.expect = "recovered"
        codes = job.wait(timeout)
        self.track(job)
        assert codes == [0] * len(job.nodes), _tails(job)
        rounds = job.events("rendezvous_done")
        last = max(e["cycle"] for e in rounds)
        assert last == cycles - 1, (
            f"expected {cycles} cycles, saw {last + 1}; failures: {failure_events(job)}; "
            f"restarts: {job.events('restart')}\n{_tails(job)}"
        )
        assert {e["code"] for e in job.events("exit")} == {0}
        if script_of(job) == FAULT_WORKER:
            for rank in range(rounds[-1]["world_size"]):
                done = job.ckpt_dir / f"done-rank{rank}"
                assert done.exists() and int(done.read_text()) == last, f"rank {rank} unfinished"
        else:
            assert (job.ckpt_dir / "FINISHED").exists(), "training did not finish"
        failures = [e for e in failure_events(job) if e["cycle"] == 0]
        assert failures, "no failure was recorded in cycle 0"
        detected = min(e["ts"] for e in failures)
        self.back_to_work(job, detected, "detection to all workers running again")
        return failures

    def back_to_work(self, job: Job, since: float, what: str) -> None:
        """Records `since` -> every worker of the last cycle started, and `since` -> every rank
        made its first step in that cycle (`stepping`)."""
        last = max(job.events("rendezvous_done"), key=lambda e: e["cycle"])
        running = max(e["ts"] for e in job.events("workers_started") if e["cycle"] == last["cycle"])
        self.time(running - since, what)
        stepped = [first_step(job, rank, last["cycle"]) for rank in range(last["world_size"])]
        self.stepping = round(max(stepped) - since, 3)

    def exited(
        self,
        job: Job,
        codes: Sequence[int],
        since: float | None = None,
        what: str = "last failure detected to every launcher exited",
        timeout: float = 60,
    ) -> None:
        """Every launcher exits with its documented code; records `since` (default: the last
        failure event) -> the last exit event."""
        self.expect = "exit " + "/".join(sorted({str(c) for c in codes}))
        got = job.wait(timeout)
        self.track(job)
        assert got == list(codes), _tails(job)
        exits = job.events("exit")
        assert sorted(e["code"] for e in exits) == sorted(codes)
        if since is None:
            since = max(e["ts"] for e in failure_events(job))
        self.time(max(e["ts"] for e in exits) - since, what)

    def track(self, job: Job) -> None:
        """Remember every worker pid of `job` (they must be gone at the end)."""
        for event in job.events("workers_started"):
            self.pids.update(event["pids"])

    @staticmethod
    def worker_pids(job: Job, node: str) -> list[int]:
        return [p for e in job.events("workers_started") if e["node"] == node for p in e["pids"]]

    @staticmethod
    def alive(pid: int) -> bool:
        return alive(pid)

    @staticmethod
    def first_line_with(text: str, needle: str) -> str:
        return next((line for line in text.splitlines() if needle in line), "")


def failure_events(job: Job) -> list[dict]:
    """Hang verdicts and non-zero worker exits, in file order."""
    return [
        e
        for e in job.events()
        if e["event"] == "hang" or (e["event"] == "worker_exited" and e["code"] != 0)
    ]


def first_step(job: Job, rank: int, cycle: int) -> float:
    """Wall time of the first step `rank` made in `cycle` (its progress file)."""
    rows = (job.ckpt_dir / f"progress-rank{rank}.txt").read_text().splitlines()
    return min(float(t) for c, _, t in (row.split() for row in rows) if int(c) == cycle)


def script_of(job: Job) -> Path:
    return Path(job.argv[job.argv.index("--ckpt-dir") - 1])


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tails(job: Job) -> str:
    return "\n".join(f"--- launcher {n.index}:\n{n.text()[-2500:]}" for n in job.nodes)


# ---- fixtures and the report ---------------------------------------------------------------

_CASES: dict[str, Fault] = {}
_PHASES: dict[str, list[pytest.TestReport]] = {}


def pytest_configure(config: pytest.Config) -> None:
    if BACKEND not in BACKENDS:
        raise pytest.UsageError(f"{BACKEND_ENV}={BACKEND!r}: expected one of {', '.join(BACKENDS)}")
    config.addinivalue_line(
        "markers",
        "backends(*names, reason): a fault-matrix case that applies only on these rendezvous "
        "backends (FTRUN_FAULTS_BACKEND); skipped elsewhere with the reason",
    )


@pytest.hookimpl(tryfirst=True)  # before any fixture: a case skipped here starts nothing
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("backends")
    if marker is not None and BACKEND not in marker.args:
        pytest.skip(f"not on {BACKEND}: {marker.kwargs['reason']}")


@pytest.fixture(scope="session")
def store_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess | None]:
    """On the store backend, the `ftrun store` of every case, stopped at the session's end."""
    if BACKEND != "store":
        yield None
        return
    store = StoreProcess(tmp_path_factory.mktemp("store") / "store.log")
    try:
        yield store
    finally:
        store.stop()
    stray = [p for p in store.pids if alive(p)]
    assert not stray, f"ftrun store still alive after the session: {stray}"


@pytest.fixture(scope="session")
def rdzv_args(
    tmp_path_factory: pytest.TempPathFactory, store_process: StoreProcess | None
) -> Iterator[tuple[str, ...]]:
    """The launcher flags of this session's backend; on etcd, one cluster for every case,
    stopped (every member SIGKILLed and reaped, none left alive) when the session ends."""
    if BACKEND == "c10d":
        yield ()
        return
    if store_process is not None:
        yield store_process.launcher_args
        return
    from etcd_cluster import EtcdCluster, etcd_binary

    try:
        etcd_binary()
    except pytest.skip.Exception as exc:  # asked for etcd: not having it is an error here
        pytest.fail(f"{BACKEND_ENV}=etcd: {exc}")
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    try:
        cluster.start()
        pids = [m.proc.pid for m in cluster.members if m.proc is not None]
        yield ("--rdzv-backend=etcd", f"--rdzv-endpoint={cluster.endpoints}")
    finally:
        cluster.stop()
    stray = [p for p in pids if alive(p)]
    assert not stray, f"etcd members still alive after the session: {stray}"


@pytest.fixture
def fault(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch,
    rdzv_args: tuple[str, ...],
) -> Iterator[Fault]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 cores: keep gloo workers from oversubscribing
    case = Fault(tmp_path, BACKEND, rdzv_args)
    _CASES[request.node.nodeid] = case
    yield case
    for job in case.jobs:
        case.track(job)
        job.kill()  # only launchers still running after a failed assertion
    stray = wait_for_gone(case.pids)
    assert not stray, f"pids of this case still alive: {stray}"


def wait_for_gone(pids: set[int], timeout: float = 10) -> list[int]:
    try:
        wait_for(lambda: not [p for p in pids if alive(p)], timeout, "the case's pids to exit")
    except AssertionError:
        return [p for p in pids if alive(p)]
    return []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    _PHASES.setdefault(report.nodeid, []).append(report)
    if report.when != "teardown":
        return
    phases = _PHASES.pop(report.nodeid)
    case = _CASES.pop(report.nodeid, None)
    outcome = _outcome(phases)
    expect = case.expect if case else ""
    if outcome == "skipped" and not expect:
        expect = _skip_reason(phases)
    record = {
        "case": report.nodeid.split("::", 1)[-1],
        "backend": BACKEND,
        "outcome": outcome,
        "expect": expect,
        "seconds": case.seconds if case else None,
        "what": case.what if case else "",
        "stepping": case.stepping if case else None,
        "wall": round(sum(r.duration for r in phases), 3),
    }
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _outcome(phases: list[pytest.TestReport]) -> str:
    for report in phases:
        if report.failed:
            return "failed" if report.when == "call" else "error"
    for report in phases:
        if report.skipped:
            return "xfailed" if hasattr(report, "wasxfail") else "skipped"
    return "passed"


def _skip_reason(phases: list[pytest.TestReport]) -> str:
    for report in phases:
        if report.skipped and isinstance(report.longrepr, tuple):
            return str(report.longrepr[2]).removeprefix("Skipped: ")
    return ""
