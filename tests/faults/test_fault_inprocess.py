"""Fault matrix, in-process restart: a wrapped training function (`ftrun.inprocess`) on
2 nodes x 2 gloo ranks (tests/workers/inprocess_worker.py), one fault at step 20 of rank 1.

Documented outcomes: a raise (in the step or while the peers wait in its collective), a hang
the rank monitor judges, and a SIGKILLed rank (alone started again) are recovered in the same
cycle, every step made once; an abort that never returns and a fault during the recovery
itself (the rank's finalize fails) escalate to the in-job restart, and the job completes.
The measured time: the fault -> every rank stepping again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conftest import matrix_only
from test_inprocess_jobs import FAULT_STEP, STEPS, WORKER, assert_recovered_in_place, steps

if TYPE_CHECKING:
    from conftest import Fault

pytestmark = pytest.mark.faults

# tests/test_inprocess_jobs.py covers these four in `make test` already: there they run only as
# part of the matrix (`make faults`), which measures them; the escalations run in both.
IN_INPROCESS_JOBS = matrix_only("test_inprocess_jobs")

JOB = ["--max-restarts=1", "--workers-stop-timeout=2"]


def run(fault: Fault, case: str, *launcher_args: str, env: dict[str, str] | None = None):
    worker = ["--steps", str(STEPS), "--fault-step", str(FAULT_STEP), "--fault", case,
              "--fault-rank", "1"]  # fmt: skip
    if case == "hang":
        worker.append("--heartbeats")
    return fault.start(2, [*JOB, *launcher_args], worker, script=WORKER, nproc=2,
                       node_env=[env or {}, env or {}])  # fmt: skip


def stepping_again(out: Path) -> float:
    """The fault -> the last rank's first step after it."""
    at = float((out / "fault.txt").read_text())
    return max(min(t for *_, t in steps(out, r) if t > at) for r in range(4)) - at


def recovered_in_process(fault: Fault, job, cycles: int = 1, replaced: int | None = None):
    fault.expect = "recovered in-process" if cycles == 1 else "escalated to the in-job restart"
    codes = job.wait(120)
    fault.track(job)
    assert codes == [0, 0], [n.text()[-2000:] for n in job.nodes]
    assert max(e["cycle"] for e in job.events("rendezvous_done")) == cycles - 1
    if cycles == 1:
        assert_recovered_in_place(job.ckpt_dir, 4, replaced=replaced)
    else:  # a new cycle's processes: every step made, none twice after the resume
        for rank in range(4):
            assert [s for *_, s, _ in steps(job.ckpt_dir, rank)][-1] == STEPS - 1
    fault.time(stepping_again(job.ckpt_dir), "fault to every rank stepping again")


@IN_INPROCESS_JOBS
@pytest.mark.parametrize("case", ["raise", "raise-late"])
def test_inprocess_raise(fault: Fault, case: str):
    recovered_in_process(fault, run(fault, case))


@IN_INPROCESS_JOBS
def test_inprocess_hang_judged_by_the_monitor(fault: Fault):
    job = run(fault, "hang", "--ft-rank-heartbeat-timeout=2")
    recovered_in_process(fault, job)
    assert "the wrapped ranks restart iteration 0" in "".join(n.text() for n in job.nodes)


@IN_INPROCESS_JOBS
def test_inprocess_sigkilled_rank(fault: Fault):
    job = run(fault, "kill")
    recovered_in_process(fault, job, replaced=1)
    assert [e["rank"] for e in job.events("rank_replaced")] == [1]


def test_inprocess_abort_that_never_returns_escalates(fault: Fault):
    job = run(fault, "abort-hangs", env={"FTRUN_INPROCESS_ABORT_TIMEOUT": "2"})
    recovered_in_process(fault, job, cycles=2)
    assert "in-process restart gives up" in "".join(n.text() for n in job.nodes)


def test_inprocess_fault_during_the_recovery_escalates(fault: Fault):
    job = run(fault, "finalize-fails")
    recovered_in_process(fault, job, cycles=2)
    assert "rank 1 leaves" in "".join(n.text() for n in job.nodes)
