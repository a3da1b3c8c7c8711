"""Every step's state in node memory (`StepSnapshot`, issue 53), with real launchers: 2 nodes x
2 gloo ranks (and a spare for the lost node), a plain script using the documented calls
(tests/workers/snapshot_worker.py). After an exception, a SIGKILL, a SIGSTOP or a lost node,
every rank resumes at the step it was in (at most one step redone), and the state it resumes
with is bit-equal to the state the run had at that step before the fault (SHA-256 of the
model's and the optimizer's tensors)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from launch import Job, node_of, start_job
from support import wait_for

pytestmark = pytest.mark.process

WORKER = Path(__file__).resolve().parent / "workers" / "snapshot_worker.py"
ARGS = [
    "--nproc-per-node=2", "--max-restarts=3", "--rdzv-conf=last_call_timeout=3",
    "--ft-rank-heartbeat-timeout=3",
]  # fmt: skip


def rows(job: Job, rank: int) -> list[tuple[str, int, int, str]]:
    text = (job.ckpt_dir / f"rank{rank}.log").read_text()
    return [(kind, int(c), int(s), d) for kind, c, s, d in map(str.split, text.splitlines())]


def newest_step(job: Job) -> int:
    path = job.ckpt_dir / "rank0.log"
    return max((s for k, _, s, _ in rows(job, 0) if k == "step"), default=0) if path.exists() else 0


def check_resumes(job: Job, world: int = 4) -> dict[int, int]:
    """For every cycle after the first: every rank resumed at one step, with the digest it had
    at that step before, at most one step behind the newest any rank finished. cycle -> step."""
    logs = {rank: rows(job, rank) for rank in range(world)}
    resumed: dict[int, int] = {}
    for rank, lines in logs.items():
        for kind, cycle, step, digest in lines:
            if kind != "resumed" or cycle == 0:
                continue
            assert resumed.setdefault(cycle, step) == step, (rank, cycle, resumed)
            before = {d for k, c, s, d in lines if k == "step" and c < cycle and s == step}
            assert before == {digest}, (rank, cycle, step, digest, before)
            done = max(s for r in logs.values() for k, c, s, _ in r if k == "step" and c < cycle)
            assert done - step <= 1, (rank, cycle, done, step)
    assert resumed, "no rank resumed"
    finals = {lines[-1] for lines in logs.values()}
    assert len({d for *_, d in finals}) == 1, finals  # DDP: every rank ends with one state
    return resumed


@pytest.mark.parametrize("kind", ["raise", "kill", "stop"])
def test_a_faulted_rank_resumes_at_its_step_bit_equal(tmp_path: Path, kind: str):
    job = start_job(tmp_path, 2, ARGS, ["--fault", f"0:3:12:{kind}"], script=WORKER, nproc=2)
    assert job.wait(120) == [0, 0], job.nodes[0].text()[-3000:]
    assert list(check_resumes(job)) == [1]
    assert (job.ckpt_dir / "FINISHED").exists()


def test_a_lost_node_resumes_on_the_spare_from_its_replicas(tmp_path: Path):
    job = start_job(tmp_path, 3, [*ARGS, "--nnodes=2"], ["--steps", "40"], script=WORKER, nproc=2)
    wait_for(lambda: newest_step(job) >= 12, 90, "12 steps")
    first = next(e for e in job.events("rendezvous_done") if e["cycle"] == 0)
    hosts = {e["node"] for e in job.events("rendezvous_done") if e.get("store_host")}
    victim = node_of(job, next(n for n in first["nodes"] if n not in hosts))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(victim.proc.pid, signal.SIGKILL)
    codes = dict(zip((n.index for n in job.nodes), job.wait(180), strict=True))
    assert codes == {n.index: -signal.SIGKILL if n is victim else 0 for n in job.nodes}
    assert list(check_resumes(job)) == [1]
    assert any(e.get("fetched") for e in job.events("ckpt_restore") if e["cycle"] == 1)
