"""Signals reach the agent in every state: a launcher whose workers already finished, waiting
for the other nodes, still leaves with 75 (preempted) on SIGTERM, and so does the job."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from ftrun.errors import ExitCode
from launch import ROOT, node_of, start_job

pytestmark = pytest.mark.process

WORKER = ROOT / "tests" / "workers" / "rank0_finishes.py"
STOP_TIMEOUT_S = 5


def test_sigterm_after_success_is_preemption(tmp_path: Path) -> None:
    job = start_job(tmp_path, 2, [f"--workers-stop-timeout={STOP_TIMEOUT_S}"], script=WORKER)
    try:
        job.wait_event("workers_started", count=2)
        finished = job.wait_event("worker_exited")[0]
        assert finished["code"] == 0 and finished["rank"] == 0
        node_of(job, finished["node"]).proc.send_signal(signal.SIGTERM)
        # Within the stop timeout (and some start-up slack), not the exit barrier's 300 s.
        codes = job.wait(timeout=STOP_TIMEOUT_S + 10)
    finally:
        job.kill()
    assert codes == [ExitCode.PREEMPTED, ExitCode.PREEMPTED], [n.text()[-2000:] for n in job.nodes]
    exits = job.events("exit")
    assert {e["reason"] for e in exits} == {"PREEMPTED"}
    # The finished rank read the cycle info file its launcher wrote for it.
    (stdout,) = job.log_dir.glob("*/cycle0/rank0/stdout.log")
    info = json.loads(stdout.read_text())
    assert (info["cycle"], info["ranks"], info["world_size"]) == (0, [0], 2)
    assert info["nodes"] == [
        e["node"] for e in sorted(job.events("rendezvous_done"), key=lambda e: e["group_rank"])
    ]
