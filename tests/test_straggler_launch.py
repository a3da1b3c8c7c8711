"""Straggler detection through real launchers: local "nodes", gloo workers timing a "step"
section with ftrun.straggler.Detector, the agents scoring them every half second (the flag), or
every `report_time_interval` the workers give `Detector.initialize` (no flag: NVRx's pattern)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftrun.errors import ExitCode
from launch import Job, node_of, start_job

pytestmark = pytest.mark.process

WORKER = Path(__file__).resolve().parent / "workers" / "straggler_worker.py"
INTERVAL = ["--ft-straggler-report-interval=0.5"]


def node_of_rank(job: Job, rank: int, cycle: int = 0) -> str:
    return next(
        e["node"]
        for e in job.events("workers_started")
        if e["cycle"] == cycle and rank in e["ranks"]
    )


def worker_reports(job: Job) -> list[dict]:
    path = job.ckpt_dir / "reports.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_rank_slowed_by_40_percent_is_named_with_its_node_within_two_intervals(tmp_path):
    job = start_job(tmp_path, 2, INTERVAL, ["--steps", "70", "--slow", "3:1.4"], WORKER, nproc=2)
    assert job.wait(90) == [0, 0]
    found = job.events("straggler")
    assert found, "no straggler found"
    first = found[0]
    # Named in the first or second report that covers its node (the first report of a cycle
    # may precede the other node's first record: its workers start later on a loaded host).
    covering = [e["seq"] for e in job.events("straggler_report") if e["ranks"] == 4]
    assert first["seq"] <= covering[1] and first["ranks"] == [3]
    assert first["nodes"] == [node_of_rank(job, 3)] and first["action"] == "log"
    assert first["findings"][0]["kind"] == "section_relative"
    assert all(e["ranks"] == [3] for e in found)  # the balanced ranks never
    # A report covers the nodes that published since the last one (the first may lack one).
    full = [e for e in job.events("straggler_report") if e["ranks"] == 4]
    assert full and all(e["worst"][0][:2] == [3, node_of_rank(job, 3)] for e in full)
    # Rank 0 read the agents' reports through Detector.generate_report_if_interval_elapsed().
    seen = worker_reports(job)
    assert any(r["step"] == [3] for r in seen)
    assert all(r["step"] == ([3] if 3 in r["ranks"] else []) for r in seen)
    log = job.nodes[0].text() + job.nodes[1].text()
    assert "Section 'step' relative performance:\n  Rank=3 Node=" in log


def test_exclude_continues_without_the_slow_node(tmp_path):
    # The last call waits 5 s: both nodes start within it on a loaded host (with 1 s, the first
    # round once closed on one node). After the exclusion the round closes at once: the
    # excluded node is known gone.
    args = [*INTERVAL, "--nnodes=1:2", "--max-restarts=1", "--rdzv-conf=last_call_timeout=5",
            "--ft-straggler-action=exclude"]  # fmt: skip
    # Cycle 0 runs until the exclusion cuts it short, however loaded the host (its 1,000 steps
    # would take 30 s); cycle 1, without the slow node, 70 steps.
    train = ["--steps", "70", "--first-cycle-steps", "1000", "--slow", "1:1.6"]
    job = start_job(tmp_path, 2, args, train, WORKER, nproc=1)
    codes = job.wait(90)
    slow = node_of(job, node_of_rank(job, 1))
    assert codes == [ExitCode.EXCLUDED if n is slow else 0 for n in job.nodes]
    straggler = job.events("straggler")[0]
    assert (straggler["action"], straggler["exclude"]) == ("exclude", slow_name(job, slow))
    cycle1 = [e for e in job.events("rendezvous_done") if e["cycle"] == 1]
    assert len(cycle1) == 1 and cycle1[0]["nodes"] == [node_of_rank(job, 0)]
    assert (job.ckpt_dir / "FINISHED").exists()


def slow_name(job: Job, node) -> str:
    return next(e["node"] for e in job.events("exit") if e["node"].endswith(f"-{node.proc.pid}"))


# ---- no launcher flag: the workers' report_time_interval (1 s) -------------------------------


def test_nvrx_s_pattern_without_the_flag_names_a_slow_rank_within_the_run(tmp_path):
    """NVRx's example: `Detector.initialize(report_time_interval=1)`, no
    --ft-straggler-report-interval (whose default would be 60 s), 1 node x 4 ranks, rank 3 40 %
    slower inside its detection section: rank 0 gets a report naming it during a few seconds of
    training, and the agent reported every second."""
    job = start_job(tmp_path, 1, [], ["--steps", "150", "--slow", "3:1.4"], WORKER, nproc=4)
    assert job.wait(90) == [0]
    started = job.events("workers_started")[0]["mono"]
    reports = job.events("straggler_report")
    assert len(reports) >= 2 and reports[0]["mono"] - started < 10
    found = job.events("straggler")
    assert found and all(e["ranks"] == [3] for e in found)
    assert found[0]["findings"][0]["kind"] == "section_relative"
    seen = worker_reports(job)
    assert any(r["step"] == [3] for r in seen), seen
    log = job.nodes[0].text()
    assert "straggler detector: a report every 1 s (this node's ranks' report_time_interval)" in (
        log
    )
    assert "disagree" not in log


def test_nvrx_s_pattern_without_the_flag_names_nobody_in_an_even_run(tmp_path):
    job = start_job(tmp_path, 1, [], ["--steps", "150"], WORKER, nproc=4)
    assert job.wait(90) == [0]
    assert len(job.events("straggler_report")) >= 2
    assert job.events("straggler") == []
    assert worker_reports(job) and all(r["step"] == [] for r in worker_reports(job))
