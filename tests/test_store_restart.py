"""The store off the training nodes (`ftrun store`, `--ft-store-reconnect-timeout`): the agents
come through a restart of that process, and losing any training node leaves the store standing.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from launch import node_of, start_job
from store_process import RECONNECT_ARG
from support import wait_for
from test_spares import SPARE, lose, rounds, standby_nodes, wait_all

pytestmark = pytest.mark.process

LIVE = ["--ft-metrics-port=0", "--ft-status-port=0"]
FAULT = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
LIGHT = ["--max-restarts=3", "--workers-stop-timeout=1", "--ft-prewarm-modules=ftrun.client_lib"]


def test_a_lost_node_and_a_restarted_store_leave_the_job_running(tmp_path, store_process):
    job = start_job(
        tmp_path, 3, [*SPARE, RECONNECT_ARG, *LIVE], ["--steps", "100", "--step-time", "0.05"],
        endpoint=f"127.0.0.1:{store_process.port}",
    )  # fmt: skip
    wait_for(lambda: len(job.progress(0)) >= 5, 90, "training on 2 nodes")
    first = rounds(job)[0]
    assert not any(e.get("store_host") for e in job.events("rendezvous_done"))
    victim = node_of(job, first[0])  # group rank 0: with an agent's store, the store's host
    lose(victim)
    wait_for(lambda: 1 in rounds(job) and any(c == 1 for c, _ in job.progress(0)), 90,
             "training again with the standby")  # fmt: skip
    store_process.restart()
    wait_for(lambda: len(job.events("store_restarted")) >= 2, 60, "both nodes see the restart")
    codes = wait_all(job, 150)

    assert codes == {n.index: -signal.SIGKILL if n is victim else 0 for n in job.nodes}
    spare = standby_nodes(job, 0).pop()
    last = rounds(job)[max(rounds(job))]
    assert last == [spare, first[1]] == rounds(job)[1]  # slots kept through the store's restart
    restarted = job.events("store_restarted")
    assert sorted(e["node"] for e in restarted) == sorted(last)  # once on each node
    assert len({e["cycle"] for e in restarted}) == 1 and max(rounds(job)) > restarted[0]["cycle"]
    assert (job.ckpt_dir / "FINISHED").exists()
    report = job.report()
    assert "the rendezvous store restarted empty" in report, report


def test_a_store_that_does_not_come_back_ends_the_job_after_the_window(tmp_path, store_process):
    job = start_job(
        tmp_path, 2, [*LIGHT, "--ft-store-reconnect-timeout=3"], ["--steps", "100000"],
        script=FAULT, endpoint=f"127.0.0.1:{store_process.port}",
    )  # fmt: skip
    wait_for(lambda: len(job.progress(0)) >= 3 and len(job.progress(1)) >= 3, 60, "training")
    store_process.proc.kill()
    store_process.proc.wait(10)
    killed_at = time.time()

    assert job.wait(60) == [1, 1]
    exits = job.events("exit")
    assert max(e["ts"] for e in exits) - killed_at < 3 + 15  # the window, then stop and leave
    for node in job.nodes:
        text = node.text()
        assert text.count("lost the rendezvous store at") == 1, text[-3000:]
        assert text.count("did not come back") == 1 and "Traceback" not in text, text[-3000:]
    assert {e["node"] for e in job.events("store_lost")} == {e["node"] for e in exits}
