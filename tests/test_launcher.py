"""Process-level tests of ft_launcher: several agents on 127.0.0.1, real gloo workers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from launch import ROOT, start_job
from support import wait_for

TRAIN = ["--steps", "20", "--save-every", "5", "--step-time", "0.02"]
FAILED, PREEMPTED = 1, 75


IMPLS = pytest.mark.parametrize("impl", ["barrier", "dynamic"])


@IMPLS
def test_crash_of_one_rank_restarts_in_job_and_resumes(tmp_path: Path, impl: str):
    args = ["--max-restarts=2", f"--ft-rdzv-impl={impl}"]
    job = start_job(tmp_path, 2, args, [*TRAIN, "--crash", "0:1:8"])
    assert job.wait(120) == [0, 0], job.nodes[0].text()[-2000:]
    crash = job.events("worker_exited")
    assert any(e["rank"] == 1 and e["code"] == 1 and e["cycle"] == 0 for e in crash)
    assert {(e["node"], e["cycle"]) for e in job.events("rendezvous_done")} >= {
        (n, 1) for n in {e["node"] for e in job.events("rendezvous_done")}
    }
    steps = job.progress(0)
    assert next(s for c, s in steps if c == 1) == 6  # resumed after the step-5 checkpoint
    assert steps[-1] == (1, 20)
    assert (job.ckpt_dir / "FINISHED").exists()
    assert {e["code"] for e in job.events("exit")} == {0}


@IMPLS
def test_heartbeat_hang_is_detected_with_its_stack_and_recovered(tmp_path: Path, impl: str):
    args = ["--max-restarts=2", "--ft-rank-heartbeat-timeout=1.5", f"--ft-rdzv-impl={impl}"]
    job = start_job(tmp_path, 2, args, [*TRAIN, "--hang", "0:1:8"])
    assert job.wait(120) == [0, 0], job.nodes[1].text()[-2000:]
    hangs = [e for e in job.events("hang") if e["rank"] == 1]
    assert hangs and hangs[0]["kind"] == "heartbeat" and hangs[0]["cycle"] == 0
    assert 0 <= hangs[0]["detection_latency"] <= 0.05
    assert "hang_in_step" in Path(hangs[0]["stack_file"]).read_text()
    assert job.progress(1)[-1] == (1, 20)


def test_section_overrun_names_rank_section_and_stack_in_one_log_line(tmp_path: Path):
    args = ["--max-restarts=1", "--ft-rank-section-timeouts=step:1.5"]
    job = start_job(tmp_path, 2, args, [*TRAIN, "--hang", "0:0:8"])
    assert job.wait(120) == [0, 0]
    hang = next(e for e in job.events("hang") if e["rank"] == 0)
    assert (hang["kind"], hang["section"]) == ("section", "step")
    assert "hang_in_step" in Path(hang["stack_file"]).read_text()
    line = next(line for n in job.nodes for line in n.text().splitlines() if "HANG: rank 0" in line)
    assert f"on node {hang['node']} in section 'step'" in line
    assert hang["stack_file"] in line


def test_workers_and_grandchildren_ignoring_sigterm_are_killed(tmp_path: Path):
    args = ["--max-restarts=0", "--workers-stop-timeout=1"]
    script = ROOT / "tests" / "workers" / "stubborn.py"
    job = start_job(tmp_path, 1, args, script=script, nproc=3)
    assert job.wait(60) == [FAILED]
    pids = [int(p) for p in (job.ckpt_dir / "pids").read_text().split()]
    assert len(pids) == 6
    stop = job.events("stop_done")[0]
    assert stop["killed"] >= 6 and stop["survivors"] == 0
    assert 1 <= stop["duration"] < 5
    assert not [p for p in pids if psutil.pid_exists(p) and _not_zombie(p)]


def test_restart_budget_spent_gives_the_same_code_on_every_node(tmp_path: Path):
    script = ROOT / "tests" / "workers" / "failing.py"
    job = start_job(tmp_path, 2, ["--max-restarts=1"], script=script)
    assert job.wait(60) == [FAILED, FAILED]
    exits = job.events("exit")
    assert len(exits) == 2 and {e["code"] for e in exits} == {FAILED}
    assert max(e["cycle"] for e in job.events("rendezvous_done")) == 1


def test_sigterm_to_one_launcher_preempts_the_whole_job(tmp_path: Path):
    job = start_job(tmp_path, 2, [], ["--steps", "100000", "--save-every", "1000"])
    wait_for(lambda: len(job.progress(0)) >= 3, 60, "training to step")
    os.kill(job.nodes[1].proc.pid, signal.SIGTERM)
    assert job.wait(60) == [PREEMPTED, PREEMPTED]
    assert (job.ckpt_dir / "checkpoint.pt").exists()  # the workers checkpointed on SIGTERM
    assert any("stopping on request" in n.text() for n in job.nodes)


def test_sigkilled_agent_does_not_leave_the_others_hanging(tmp_path: Path):
    args = ["--max-restarts=3", "--rdzv-conf=join_timeout=5"]
    job = start_job(tmp_path, 2, args, ["--steps", "100000"])
    wait_for(lambda: len(job.progress(1)) >= 3, 60, "training to step")
    guest = next(e["node"] for e in job.events("rendezvous_done") if not e["store_host"])
    victim = next(n for n in job.nodes if guest.endswith(f"-{n.proc.pid}"))
    victim.proc.kill()  # the agent of a node that does not serve the store
    survivor = next(n for n in job.nodes if n is not victim)
    assert survivor.proc.wait(timeout=60) == FAILED
    victim.proc.wait()


@IMPLS
def test_infra_group_rank_follows_slurm_procid_across_restarts(tmp_path: Path, impl: str):
    envs = [{"SLURM_PROCID": str(i), "SLURMD_NODENAME": f"n{i}"} for i in range(2)]
    args = ["--max-restarts=1", "--ft-use-infra-group-rank", f"--ft-rdzv-impl={impl}"]
    job = start_job(tmp_path, 2, args, [*TRAIN, "--crash", "0:0:3"], node_env=envs, order=[1, 0])
    assert job.wait(120) == [0, 0]
    seen = {(e["node"], e["cycle"]): e["group_rank"] for e in job.events("rendezvous_done")}
    assert seen == {("n0", 0): 0, ("n1", 0): 1, ("n0", 1): 0, ("n1", 1): 1}


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def _fast_cpu_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 cores: keep gloo workers from oversubscribing
