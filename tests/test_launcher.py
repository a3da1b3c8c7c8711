"""Process-level tests of ft_launcher: several agents on 127.0.0.1, real gloo workers.

Faults with a case in the fault matrix (tests/faults: hangs, stubborn process trees, a spent
restart budget, a SIGKILLed agent) are tested there, not repeated here.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from launch import start_job
from support import wait_for

pytestmark = pytest.mark.process

TRAIN = ["--steps", "20", "--save-every", "5", "--step-time", "0.02"]
PREEMPTED = 75


IMPLS = pytest.mark.parametrize("impl", ["barrier", "dynamic"])


@IMPLS
def test_crash_of_one_rank_restarts_in_job_and_resumes(tmp_path: Path, impl: str):
    # Under Slurm (SLURM_PROCID, the nodes started in reverse): each node keeps the group rank
    # of its procid, in the first cycle and after the restart.
    envs = [{"SLURM_PROCID": str(i), "SLURMD_NODENAME": f"n{i}"} for i in range(2)]
    args = ["--max-restarts=2", "--ft-use-infra-group-rank", f"--ft-rdzv-impl={impl}"]
    job = start_job(tmp_path, 2, args, [*TRAIN, "--crash", "0:1:8"], node_env=envs, order=[1, 0])
    assert job.wait(120) == [0, 0], job.nodes[0].text()[-2000:]
    seen = {(e["node"], e["cycle"]): e["group_rank"] for e in job.events("rendezvous_done")}
    assert seen == {("n0", 0): 0, ("n1", 0): 1, ("n0", 1): 0, ("n1", 1): 1}
    # Each node's fork server inherited its launcher's torch import (no second import).
    assert all("forked from the agent" in node.text() for node in job.nodes)
    crash = job.events("worker_exited")
    assert any(e["rank"] == 1 and e["code"] == 1 and e["cycle"] == 0 for e in crash)
    rounds = {(e["node"], e["cycle"]) for e in job.events("rendezvous_done")}
    nodes = {node for node, _ in rounds}
    assert len(nodes) == 2 and rounds == {(n, c) for n in nodes for c in (0, 1)}  # one restart
    steps = job.progress(0)
    assert next(s for c, s in steps if c == 1) == 6  # resumed after the step-5 checkpoint
    assert steps[-1] == (1, 20)
    assert (job.ckpt_dir / "FINISHED").exists()
    assert {e["code"] for e in job.events("exit")} == {0}


def test_sigterm_to_one_launcher_preempts_the_whole_job(tmp_path: Path):
    job = start_job(tmp_path, 2, [], ["--steps", "100000", "--save-every", "1000"])
    wait_for(lambda: len(job.progress(0)) >= 3, 60, "training to step")
    os.kill(job.nodes[1].proc.pid, signal.SIGTERM)
    assert job.wait(60) == [PREEMPTED, PREEMPTED]
    assert (job.ckpt_dir / "checkpoint.pt").exists()  # the workers checkpointed on SIGTERM
    assert any("stopping on request" in n.text() for n in job.nodes)


@pytest.fixture(autouse=True)
def _fast_cpu_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 cores: keep gloo workers from oversubscribing
