"""Every step's state in node memory (`StepSnapshot`, issue 53), with real launchers: 2 nodes x
2 gloo ranks and a spare, a plain script using the documented calls
(tests/workers/snapshot_worker.py). One job meets four faults in turn, one a restart: an
exception, a SIGKILL, a SIGSTOP (a hung rank, found by its heartbeats) and a lost node (its
launcher's process group SIGKILLed; the spare takes its place). Each test reads the restart
after its fault: every rank resumes at the step it was in (at most one step redone), with the
state the run had at that step before the fault, bit for bit (SHA-256 of the model's and the
optimizer's tensors)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from launch import Job, node_of, snapshot_rows, start_job
from support import wait_for

pytestmark = pytest.mark.process

WORKER = Path(__file__).resolve().parent / "workers" / "snapshot_worker.py"
ARGS = [
    "--nnodes=2", "--nproc-per-node=2", "--max-restarts=5", "--rdzv-conf=last_call_timeout=3",
    "--ft-rank-heartbeat-timeout=3",
]  # fmt: skip
FAULTS = "0:3:8:raise,1:2:14:kill,2:1:20:stop"  # the node is lost in cycle 3, past step 26
CYCLE_AFTER = {"raise": 1, "kill": 2, "stop": 3, "node": 4}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("snapshots")
    job = start_job(tmp, 3, ARGS, ["--steps", "40", "--fault", FAULTS], script=WORKER, nproc=2)
    try:
        wait_for(lambda: newest(job, cycle=3) >= 26, 150, "cycle 3 at step 26")
        latest = max((e for e in job.events("rendezvous_done")), key=lambda e: e["cycle"])
        hosts = {e["node"] for e in job.events("rendezvous_done") if e.get("store_host")}
        victim = node_of(job, next(n for n in latest["nodes"] if n not in hosts))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.proc.pid, signal.SIGKILL)
        codes = dict(zip((n.index for n in job.nodes), job.wait(180), strict=True))
    except BaseException:
        job.kill()
        raise
    assert codes == {n.index: -signal.SIGKILL if n is victim else 0 for n in job.nodes}, job.nodes[
        0
    ].text()[-3000:]
    return job


def newest(job: Job, cycle: int) -> int:
    return max((s for k, c, s, _ in snapshot_rows(job, 0) if k == "step" and c == cycle), default=0)


@pytest.mark.parametrize("fault", list(CYCLE_AFTER))
def test_a_fault_resumes_at_its_step_bit_equal(job: Job, fault: str):
    cycle = CYCLE_AFTER[fault]
    logs = {rank: snapshot_rows(job, rank) for rank in range(4)}
    done = max(s for r in logs.values() for k, c, s, _ in r if k == "step" and c < cycle)
    resumed = set()
    for rank, lines in logs.items():
        (step, digest), *_ = [(s, d) for k, c, s, d in lines if k == "resumed" and c == cycle]
        before = {d for k, c, s, d in lines if k == "step" and c < cycle and s == step}
        assert before == {digest}, (fault, rank, step, digest, before)
        resumed.add(step)
    assert len(resumed) == 1 and done - resumed.pop() <= 1, (fault, resumed, done)
    if fault == "node":  # the spare's agent fetched its ranks' parts from their replicas
        assert any(e.get("fetched") for e in job.events("ckpt_restore") if e["cycle"] == cycle)


def test_the_job_ends_with_one_state_on_every_rank(job: Job):
    finals = {snapshot_rows(job, rank)[-1] for rank in range(4)}
    assert len({(k, s, d) for k, _, s, d in finals}) == 1, finals  # DDP: the same state
    assert (job.ckpt_dir / "FINISHED").exists()
