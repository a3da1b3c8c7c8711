"""Fault matrix, agent faults: a launcher SIGKILLed (store host or not), preemption of every
launcher, and a restart budget that runs out.

Documented outcomes (README, exit codes): a survivor of a dead peer exits 1 (FAILED), never
hangs, and the dead agent's workers die with it (PR_SET_PDEATHSIG); SIGTERM to the
launchers exits 75 (PREEMPTED) everywhere after the workers checkpointed; a spent budget exits 1
everywhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

from launch import Job, Node, node_of
from support import wait_for

if TYPE_CHECKING:
    from conftest import Fault

pytestmark = pytest.mark.faults
FAILED, PREEMPTED = 1, 75
FOREVER = ["--steps", "100000"]
SURVIVOR_DEADLINE_S = 60
ORPHANS_DEADLINE_S = 10


def training(job: Job, ranks: int = 2, steps: int = 3) -> None:
    wait_for(
        lambda: all(len(job.progress(r)) >= steps for r in range(ranks)), 90, "training to step"
    )


def split(job: Job, store_host: bool) -> tuple[Node, str, Node]:
    """(the launcher that does / does not serve the store, its event node name, the other)."""
    name = next(e["node"] for e in job.events("rendezvous_done") if e["store_host"] is store_host)
    victim = node_of(job, name)
    return victim, name, next(n for n in job.nodes if n is not victim)


def kill_agent(fault: Fault, job: Job, store_host: bool) -> tuple[Node, Node, list[int], float]:
    victim, name, survivor = split(job, store_host)
    fault.track(job)
    orphans = fault.worker_pids(job, name)
    assert orphans, f"no worker of {name} was recorded"
    killed_at = time.time()
    victim.proc.kill()
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    return victim, survivor, orphans, killed_at


def survivor_exits(fault: Fault, job: Job, survivor: Node, killed_at: float) -> None:
    """The survivor exits 1 (a deadline that only tells a hang apart; `make faults` records
    how long it took)."""
    fault.expect = "exit 1 (survivor)"
    try:
        code = survivor.proc.wait(timeout=SURVIVOR_DEADLINE_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"survivor still running {SURVIVOR_DEADLINE_S}s after its peer was killed:\n"
            f"{survivor.text()[-3000:]}"
        ) from None
    assert code == FAILED, survivor.text()[-3000:]
    fault.track(job)
    exits = [e for e in job.events("exit") if survivor.proc.pid == _pid(e["node"])]
    assert [e["code"] for e in exits] == [FAILED]
    fault.time(exits[0]["ts"] - killed_at, "agent killed to survivor exited")


def test_agent_sigkill_on_a_non_store_node(fault: Fault):
    """Gloo workers: the survivor's rank fails when its peer's rank dies with its agent; the
    restart's rendezvous then times out (join_timeout=3) and the survivor exits 1."""
    args = [
        "--max-restarts=3",
        "--workers-stop-timeout=1",
        "--rdzv-conf=join_timeout=3",
        "--ft-prewarm-modules=none",
    ]
    job = fault.start(2, args, [*FOREVER, "--save-every", "1000"])
    training(job)
    _, survivor, orphans, killed_at = kill_agent(fault, job, store_host=False)
    wait_for(
        lambda: not [p for p in orphans if fault.alive(p)],
        ORPHANS_DEADLINE_S,
        "workers to die with their agent",
    )
    survivor_exits(fault, job, survivor, killed_at)
    assert "rendezvous did not complete within join_timeout=3.0s" in survivor.text()


def test_agent_sigkill_on_the_store_host(fault: Fault):
    """The survivor loses the store: one clear log line, its workers stopped, exit 1."""
    job = fault.light([], steps=FOREVER)
    training(job)
    _, survivor, orphans, killed_at = kill_agent(fault, job, store_host=True)
    wait_for(
        lambda: not [p for p in orphans if fault.alive(p)],
        ORPHANS_DEADLINE_S,
        "workers to die with their agent",
    )
    survivor_exits(fault, job, survivor, killed_at)
    lost = [line for line in survivor.text().splitlines() if "lost the rendezvous store" in line]
    assert len(lost) == 1 and "Traceback" not in survivor.text()
    assert [e["node"] for e in job.events("store_lost")] == [
        e["node"] for e in job.events("exit") if e["code"] == FAILED
    ]


def test_sigterm_to_every_launcher_preempts(fault: Fault):
    job = fault.light([], steps=FOREVER)
    training(job)
    sent_at = time.time()
    for node in job.nodes:
        os.kill(node.proc.pid, signal.SIGTERM)
    fault.exited(job, [PREEMPTED, PREEMPTED], since=sent_at, what="SIGTERM sent to every exit")
    for rank in range(2):  # the workers got the SIGTERM and checkpointed
        assert (job.ckpt_dir / f"checkpoint-rank{rank}").exists()
    assert job.events("signal") and all(e["signal"] == "SIGTERM" for e in job.events("signal"))


def test_restart_budget_spent(fault: Fault):
    """Rank 1 exits 3 at step 3 of every cycle; --max-restarts=1 allows one restart."""
    job = fault.light(["--exit", "*:1:3:3"], ["--max-restarts=1"], steps=["--steps", "100"])
    fault.exited(job, [FAILED, FAILED])
    assert {e["cycle"] for e in job.events("rendezvous_done")} == {0, 1}
    assert len([e for e in job.events("worker_exited") if e["code"] == 3]) == 2
    for node in job.nodes:
        assert "restart budget spent (2 failures, --max-restarts=1)" in node.text()


def _pid(event_node: str) -> int:
    return int(event_node.rsplit("-", 1)[1])
