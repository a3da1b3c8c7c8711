"""Whole jobs on `--rdzv-backend=etcd` (a real 3-member etcd cluster on 127.0.0.1): restarts as
on TCPStore, etcd members lost while training and while the nodes meet, the leader lost and
the whole cluster restarted, and the first node lost with a standby waiting, which TCPStore
cannot survive (its store lives in that agent).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from ftrun.store.etcd_members import spread_start
from launch import Job, node_of, start_job
from support import wait_for
from test_spares import SPARE, lose, rounds, standby_nodes, wait_all

pytestmark = pytest.mark.process

FAULT = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
LIGHT = ["--max-restarts=3", "--workers-stop-timeout=1", "--ft-rank-heartbeat-timeout=2",
         "--ft-prewarm-modules=ftrun.client_lib"]  # fmt: skip


def on_etcd(cluster: Any) -> list[str]:
    return ["--rdzv-backend=etcd", f"--rdzv-endpoint={cluster.endpoints}"]


def lines_with(job: Job, text: str) -> list[str]:
    return [line for node in job.nodes for line in node.text().splitlines() if text in line]


def test_etcd_members_lost_while_training_and_while_meeting(tmp_path: Path, etcd_cluster: Any):
    # Cycle 0 trains while the member launcher 0 uses dies; rank 1 raises at step 60, and the
    # next member dies as the nodes meet again (the first is back by then: two of three keep
    # the quorum). Each launcher starts on the member its pid picks (`spread_start`).
    job = start_job(
        tmp_path, 2, [*LIGHT, *on_etcd(etcd_cluster)],
        ["--steps", "80", "--step-time", "0.02", "--raise", "0:1:60"], script=FAULT, nproc=2,
    )  # fmt: skip
    first = spread_start(len(etcd_cluster.members), job.nodes[0].proc.pid)
    wait_for(lambda: len(job.progress(0)) >= 10, 60, "training")
    etcd_cluster.kill(first)
    wait_for(lambda: len(job.progress(0)) >= 30, 60, "training without that member")
    etcd_cluster.start(first)
    job.wait_event("failure")
    etcd_cluster.kill((first + 1) % len(etcd_cluster.members))
    assert job.wait(90) == [0, 0]
    # The raise restarts the job as on TCPStore: one round a node in cycles 0 and 1, the
    # exception its one named failure.
    formed = job.events("rendezvous_done")
    assert sorted(e["cycle"] for e in formed) == [0, 0, 1, 1]
    assert not any(e.get("store_host") for e in formed)  # no training node holds the store
    assert [f["key"].split(":")[0] for f in job.failures()] == ["exception"]
    # A launcher says so once when the member it was using stops answering (it may have
    # moved to another member before: then it says nothing at all), never once per request nor
    # once per client (its clients share what they saw: `MemberHealth`); twice where a member
    # under load missed a request's deadline once too.
    said = lines_with(job, "does not answer")
    assert said, "no launcher noticed a member going away"
    for member in etcd_cluster.members:
        assert len([line for line in said if member.endpoint in line]) <= 2 * len(job.nodes)


def test_the_etcd_leader_lost_then_the_whole_cluster_restarted(tmp_path: Path, etcd_cluster: Any):
    # The leader dies while the job trains (an election under the launchers' requests), comes
    # back; then all three members die at once and start again on their data (a whole store
    # restart: the job's keys and its lease are on disk). Rank 1 raises at step 150, so the
    # nodes meet again on the restarted cluster, or while it restarts, whichever comes first.
    job = start_job(
        tmp_path, 2, [*LIGHT, *on_etcd(etcd_cluster)],
        ["--steps", "200", "--step-time", "0.02", "--raise", "0:1:150"], script=FAULT, nproc=2,
    )  # fmt: skip
    wait_for(lambda: len(job.progress(0)) >= 10, 60, "training")
    leader = etcd_cluster.leader()
    etcd_cluster.kill(leader)
    done = len(job.progress(0))
    wait_for(lambda: len(job.progress(0)) >= done + 20, 60, "training without the leader")
    etcd_cluster.start(leader)
    for index in range(len(etcd_cluster.members)):
        etcd_cluster.kill(index)
    etcd_cluster.start()
    assert job.wait(120) == [0, 0]
    assert max(e["cycle"] for e in job.events("rendezvous_done")) == 1
    assert all((job.ckpt_dir / f"done-rank{rank}").exists() for rank in range(4))
    # Each member was lost at most twice; a launcher says so once a loss (twice under load,
    # as above), never once a request.
    said = lines_with(job, "does not answer")
    for member in etcd_cluster.members:
        assert len([line for line in said if member.endpoint in line]) <= 4 * len(job.nodes)


def test_the_first_node_lost_a_standby_takes_its_slot(tmp_path: Path, etcd_cluster: Any):
    job = start_job(
        tmp_path, 3, [*SPARE, *on_etcd(etcd_cluster)], ["--steps", "60", "--step-time", "0.05"]
    )
    wait_for(lambda: len(job.progress(0)) >= 5, 90, "training on 2 nodes")
    first = rounds(job)[0]
    victim = node_of(job, first[0])  # group rank 0: with TCPStore, the store's host
    lose(victim)
    codes = wait_all(job, 120)
    assert codes == {n.index: -signal.SIGKILL if n is victim else 0 for n in job.nodes}
    spare = standby_nodes(job, 0).pop()
    assert rounds(job)[max(rounds(job))] == [spare, first[1]]
    assert (job.ckpt_dir / "FINISHED").exists()
