"""Health gating and elastic membership: who may join a round, and who replaces whom."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from ftrun.agent.node_services.health import check_node
from ftrun.config.agent import HealthCheckConfig
from ftrun.errors import NodeUnhealthyError
from launch import ROOT, node_of, start_job
from support import wait_for

pytestmark = pytest.mark.process

FAKES = ROOT / "tests" / "fakes"
LIGHT = ROOT / "tests" / "workers" / "fault_worker.py"
HEALTHY = json.dumps({"devices": 2})
BROKEN = json.dumps({"devices": 2, "faults": {"1": ["retired_pages"]}})


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        (["retired_pages"], "GPU 1: retired pages pending"),
        (["remapped_rows"], "GPU 1: row remapping pending or failed"),
        (["ecc"], "GPU 1: 3 uncorrected ECC errors"),
        (["unreachable"], "NVML query failed"),
    ],
)
def test_gpu_faults_make_the_node_unhealthy(fake_nvml, faults, message):
    fake_nvml.setenv("FAKE_NVML", json.dumps({"devices": 2, "faults": {"1": faults}}))
    with pytest.raises(NodeUnhealthyError, match=message):
        check_node(HealthCheckConfig())


def test_nvlink_is_checked_only_when_asked(fake_nvml):
    fake_nvml.setenv("FAKE_NVML", json.dumps({"devices": 1, "faults": {"0": ["nvlink"]}}))
    assert check_node(HealthCheckConfig())["gpus"] == 1
    with pytest.raises(NodeUnhealthyError, match=r"NVLink\(s\) \[0, 1\] down"):
        check_node(HealthCheckConfig(nvlink=True))


def test_no_driver_skips_the_gpu_check(fake_nvml):
    fake_nvml.delenv("FAKE_NVML", raising=False)
    assert check_node(HealthCheckConfig())["gpus"] == 0


def test_storage_and_command_checks(tmp_path: Path):
    readable = tmp_path / "readable"
    readable.write_text("x")
    storage = HealthCheckConfig(gpu=False, storage_paths=(str(tmp_path), str(readable)))
    assert check_node(storage) == {"storage_paths": 2}
    assert check_node(HealthCheckConfig(gpu=False, command="true")) == {
        "storage_paths": 0,
        "command": "ok",
    }
    with pytest.raises(NodeUnhealthyError, match="storage /nonexistent"):
        check_node(HealthCheckConfig(gpu=False, storage_paths=("/nonexistent",)))
    with pytest.raises(NodeUnhealthyError, match="health command exited 1: sick"):
        check_node(HealthCheckConfig(gpu=False, command="echo sick; exit 1"))
    with pytest.raises(NodeUnhealthyError, match=r"timed out after 0\.3s"):
        check_node(HealthCheckConfig(gpu=False, command="sleep 30", command_timeout=0.3))


def nvml_env(specs: list[str]) -> list[dict[str, str]]:
    return [{"PYTHONPATH": str(FAKES), "FAKE_NVML": spec} for spec in specs]


def test_broken_gpu_node_never_runs_workers_and_the_rest_finish(tmp_path: Path):
    args = ["--nnodes=1:2", "--rdzv-conf=last_call_timeout=1"]
    envs = nvml_env([HEALTHY, BROKEN])
    # The light script (no torch): which node runs workers is the point.
    job = start_job(tmp_path, 2, args, ["--steps", "20"], node_env=envs, script=LIGHT)
    assert job.wait(120) == [0, 3]
    sick = job.events("unhealthy")
    assert len(sick) == 1 and "retired pages pending" in sick[0]["reason"]
    started = {e["node"] for e in job.events("workers_started")}
    assert len(started) == 1 and sick[0]["node"] not in started
    assert (job.ckpt_dir / "done-rank0").read_text() == "0\n"  # its one rank made every step


def test_when_every_node_is_unhealthy_each_exits_do_not_relaunch(tmp_path: Path):
    """Nobody may host the store, so nobody can be told: each leaves on its own health."""
    conf = ["--rdzv-conf=read_timeout=3"]
    # No worker ever starts: the light script (no torch) spares each fork server its imports.
    job = start_job(tmp_path, 2, conf, node_env=nvml_env([BROKEN, BROKEN]), script=LIGHT)
    assert job.wait(60) == [3, 3]
    for launcher in job.nodes:
        assert "node unhealthy: GPU 1: retired pages pending" in launcher.text()
    assert not job.events("workers_started")


def test_elastic_job_continues_without_a_dead_node_and_takes_a_new_one(tmp_path: Path):
    # 1:2 (the smallest elastic job): the round goes down to the store's node and up again.
    args = ["--nnodes=1:2", "--max-restarts=3", "--rdzv-conf=last_call_timeout=1"]
    # 160 steps: the newcomer joins about 30 steps in; the rest of the run only has to outlast
    # its start, under the other xdist worker's load too.
    job = start_job(tmp_path, 2, args, ["--steps", "160", "--step-time", "0.05"])
    wait_for(lambda: len(job.progress(0)) >= 3, 90, "training on 2 nodes")
    first = job.events("rendezvous_done")
    assert {len(e["nodes"]) for e in first} == {2}
    guest = next(e["node"] for e in first if not e["store_host"])
    node_of(job, guest).proc.kill()
    wait_for(
        lambda: any(len(e["nodes"]) == 1 for e in job.events("rendezvous_done")),
        60,
        "a round of 1 node",
    )
    job.add_node(2)
    wait_for(
        lambda: any(len(e["nodes"]) == 2 and e["cycle"] > 1 for e in job.events("rendezvous_done")),
        90,
        "the new node to join",
    )
    codes = dict(zip((n.index for n in job.nodes), job.wait(180), strict=True))
    killed = node_of(job, guest).index
    # the two survivors and the newcomer finish; the killed one was SIGKILLed
    assert codes == {n.index: -signal.SIGKILL if n.index == killed else 0 for n in job.nodes}
    rounds = job.events("rendezvous_done")
    last = max(e["cycle"] for e in rounds)
    final = {node_of(job, name).index for e in rounds if e["cycle"] == last for name in e["nodes"]}
    assert final == {n.index for n in job.nodes} - {killed}
    assert (job.ckpt_dir / "FINISHED").exists()
