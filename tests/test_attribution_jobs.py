"""Attribution with real launchers: a health fault while training, and the rank a collective
waits for named by the flight recorders (2 nodes x 2 ranks, plus a standby). Failures that
repeat, on one node or across nodes: tests/test_repeats.py decides them without processes,
tests/test_repeated_failure_jobs.py runs them on 1 and 2 nodes.

The ranks are tests/workers/fault_worker.py (no torch: the decisions are the agents') and
tests/workers/collective_worker.py (gloo collectives for the flight recorders).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ftrun.errors import ExitCode
from launch import start_job
from support import wait_for
from test_spares import killable, rounds, standby_nodes, wait_all

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent
FAULT = ROOT / "workers" / "fault_worker.py"
COLLECTIVE = ROOT / "workers" / "collective_worker.py"
FAKES = ROOT / "fakes"
TWO_BY_TWO = ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=5",
              "--rdzv-conf=last_call_timeout=5"]  # fmt: skip
POLL_S = 0.2


def test_an_xid_while_training_excludes_the_node_and_the_standby_takes_its_slot(tmp_path: Path):
    xids = [tmp_path / f"xids{i}" for i in range(3)]
    envs = [{"PYTHONPATH": str(FAKES), "FAKE_NVML": json.dumps({"devices": 1,
             "xid_file": str(path)})} for path in xids]  # fmt: skip
    job = start_job(
        tmp_path, 3, [*TWO_BY_TWO, f"--ft-health-interval={POLL_S}"],
        ["--steps", "200", "--step-time", "0.05"], script=FAULT, node_env=envs,
    )  # fmt: skip
    # 200 steps (10 s): under the suite's load, 80 once ended before the Xid was acted on.
    wait_for(lambda: len(job.progress(0)) >= 5, 90, "training on 2 nodes")
    # The node may leave only once a standby waits: an Xid seen before then is logged and the
    # node stays (the agent's decision, `policy._health_found`); under the suite's load the
    # third launcher once stood by 0.4 s after the Xid, and the job ended 0 on 2 nodes.
    wait_for(lambda: job.events("standby"), 90, "the third node standing by")
    first = rounds(job)[0]
    victim = killable(job, 0)
    name = next(n for n in first if n.endswith(f"-{victim.proc.pid}"))
    injected = time.time()
    xids[victim.index].write_text("0 79\n")
    codes = wait_all(job, 120)
    assert codes == {n.index: ExitCode.EXCLUDED if n is victim else 0 for n in job.nodes}
    [finding] = job.events("health_finding")
    assert (finding["node"], finding["finding"], finding["fault"]) == (name, "Xid 79", True)
    assert finding["ts"] - injected < POLL_S + 1.0  # one poll, and this host's scheduling
    spare = standby_nodes(job, 0).pop()
    assert rounds(job)[1] == [spare if n == name else n for n in first]
    assert [(f["node"], f["key"]) for f in job.failures()] == [(name, "health: Xid 79")]
    assert all(e["node"] != name for e in job.events("rendezvous_done") if e["cycle"] == 1)


def test_a_rank_that_skips_an_all_reduce_is_named_by_the_flight_recorders(tmp_path: Path):
    job = start_job(
        tmp_path, 2, ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=1",
                      "--ft-rank-heartbeat-timeout=2"],
        ["--skip", "0:3:10", "--steps", "30"], script=COLLECTIVE,
    )  # fmt: skip
    codes = wait_all(job, 120)
    assert set(codes.values()) == {0}
    found = job.events("collectives")[0]  # from each node that judged ranks hung
    assert all(e["summary"] == found["summary"] for e in job.events("collectives"))
    assert (found["op"], found["seq"], found["missing"]) == ("all_reduce", 10, [3])
    assert found["entered"] == [0, 1, 2] and found["last_completed"] == 9
    assert sorted(found["nodes_answered"]) == sorted(rounds(job)[0])
    kept = list(job.log_dir.glob("*/cycle0/flight-rank*.json"))
    assert len(kept) == 4
    assert "rank(s) 3 never entered all_reduce seq 10" in job.report()
