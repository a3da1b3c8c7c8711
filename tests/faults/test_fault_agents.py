"""Fault matrix, agent faults: a launcher SIGKILLed (store host or not; the first node with a
standby waiting), preemption of every launcher, and a restart budget that runs out.

Documented outcomes (README, exit codes): a survivor of a dead peer exits 1 (FAILED), never
hangs, and the dead agent's workers die with it (PR_SET_PDEATHSIG); SIGTERM to the
launchers exits 75 (PREEMPTED) everywhere after the workers checkpointed; a spent budget exits 1
everywhere.

Where the store lives decides what losing the first node means. On c10d the first agent serves
the job's TCPStore: losing it ends the job (every other launcher exits 1, "lost the rendezvous
store"), even with a standby waiting. On etcd no training node holds the store (`store_host` is
false everywhere): losing any node, the first included, is a node lost like any other, and a
standby takes its slot. `test_agent_sigkill_on_the_first_node_with_a_standby` asserts both;
`test_agent_sigkill_on_the_store_host` runs on c10d only (on etcd there is no store host). The
store backend (`ftrun store`) is etcd's case for the first node, and adds its own: the store
process restarted (`test_the_store_process_restarted`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

from conftest import matrix_only
from launch import Job, Node, node_of
from store_process import StoreProcess
from support import wait_for

if TYPE_CHECKING:
    from conftest import Fault

pytestmark = pytest.mark.faults
FAILED, PREEMPTED = 1, 75
FOREVER = ["--steps", "100000"]
SURVIVOR_DEADLINE_S = 60
ORPHANS_DEADLINE_S = 10
STANDBY_STEPS = 300
"""15 s of cycle 0 at 50 ms a step: a third launcher must start and stand by within it, which took
over 6.5 s (the 150 steps before) twice under the suite's load in the sixteenth session. On c10d
the job ends at the kill, so the length costs nothing there."""
STANDBY_ARGS = [
    "--max-restarts=3",
    "--workers-stop-timeout=1",
    "--rdzv-conf=last_call_timeout=5",
    "--ft-prewarm-modules=none",
]


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
    orphans, killed_at = sigkill(fault, job, victim, name)
    return victim, survivor, orphans, killed_at


def sigkill(fault: Fault, job: Job, victim: Node, name: str) -> tuple[list[int], float]:
    """SIGKILL the agent `victim` (events node `name`): its workers, and when it was killed."""
    fault.track(job)
    orphans = fault.worker_pids(job, name)
    assert orphans, f"no worker of {name} was recorded"
    killed_at = time.time()
    victim.proc.kill()
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    return orphans, killed_at


def orphans_die(fault: Fault, orphans: list[int]) -> None:
    wait_for(
        lambda: not [p for p in orphans if fault.alive(p)],
        ORPHANS_DEADLINE_S,
        "workers to die with their agent",
    )


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
    restart's rendezvous then times out (join_timeout=3) and the survivor exits 1. The same on
    etcd, where every node is a non-store node: without a standby, 2 of 2 nodes cannot meet."""
    args = [
        "--max-restarts=3",
        "--workers-stop-timeout=1",
        "--rdzv-conf=join_timeout=3",
        "--ft-prewarm-modules=none",
    ]
    job = fault.start(2, args, [*FOREVER, "--save-every", "1000"])
    training(job)
    _, survivor, orphans, killed_at = kill_agent(fault, job, store_host=False)
    orphans_die(fault, orphans)
    survivor_exits(fault, job, survivor, killed_at)
    assert "rendezvous did not complete within join_timeout=3.0s" in survivor.text()


@pytest.mark.backends(
    "c10d",
    reason="no node hosts the store there (store_host is false everywhere); "
    "test_agent_sigkill_on_the_first_node_with_a_standby loses the first node instead",
)
def test_agent_sigkill_on_the_store_host(fault: Fault):
    """The survivor loses the store: one clear log line, its workers stopped, exit 1."""
    job = fault.light([], steps=FOREVER)
    training(job)
    _, survivor, orphans, killed_at = kill_agent(fault, job, store_host=True)
    orphans_die(fault, orphans)
    survivor_exits(fault, job, survivor, killed_at)
    lost = [line for line in survivor.text().splitlines() if "lost the rendezvous store" in line]
    assert len(lost) == 1 and "Traceback" not in survivor.text()
    assert [e["node"] for e in job.events("store_lost")] == [
        e["node"] for e in job.events("exit") if e["code"] == FAILED
    ]


@matrix_only("on c10d, test_agent_sigkill_on_the_store_host; a lost store: test_policy.py")
def test_agent_sigkill_on_the_first_node_with_a_standby(fault: Fault):
    """2 nodes of gloo workers and a standby (a third launcher, started once the two met); the
    agent of the first node is SIGKILLed: on c10d the node that serves the store, on etcd
    group rank 0 (no node serves it there).

    c10d: the job ends: the survivor and the standby lose the store, say so in one log line
    each and exit 1. etcd: the job goes on: the survivor's rank fails in gloo, the lost node is
    named, the standby takes its slot in cycle 1 (the survivor keeps its own), training
    finishes, both exit 0, and no launcher ever lost the store."""
    job = fault.start(2, STANDBY_ARGS, ["--steps", str(STANDBY_STEPS), "--step-time", "0.05"])
    training(job)
    standby = job.add_node(2)
    job.wait_event("standby")
    assert len(job.progress(0)) < STANDBY_STEPS - 20, "cycle 0 nearly over before the kill"
    cycle0 = [e for e in job.events("rendezvous_done") if e["cycle"] == 0]
    hosts = [e["node"] for e in cycle0 if e["store_host"]]
    if fault.backend == "c10d":
        assert len(hosts) == 1, cycle0
        name = hosts[0]
    else:
        assert not hosts, f"a node claims to host the store on etcd: {cycle0}"
        name = next(e["node"] for e in cycle0 if e["group_rank"] == 0)
    victim = node_of(job, name)
    survivor = next(n for n in job.nodes if n is not victim and n is not standby)
    orphans, killed_at = sigkill(fault, job, victim, name)
    orphans_die(fault, orphans)
    others = [survivor, standby]
    if fault.backend == "c10d":
        fault.expect = "exit 1 (store lost)"
        codes = [n.proc.wait(timeout=SURVIVOR_DEADLINE_S) for n in others]
        fault.track(job)
        assert codes == [FAILED, FAILED], "\n".join(n.text()[-2500:] for n in others)
        for node in others:  # the survivor's rank dies in gloo too: its traceback is its own
            own = agent_lines(node)
            lost = [line for line in own if "lost the rendezvous store" in line]
            assert len(lost) == 1 and not [ln for ln in own if "Traceback" in ln], node.text()
        assert len(job.events("store_lost")) == 2
        exits = job.events("exit")
        assert sorted(e["code"] for e in exits) == [FAILED, FAILED]
        fault.time(max(e["ts"] for e in exits) - killed_at, "agent killed to every other exited")
        return
    fault.expect = "recovered (standby took the slot)"
    codes = [n.proc.wait(timeout=90) for n in others]
    fault.track(job)
    assert codes == [0, 0], "\n".join(n.text()[-2500:] for n in others)
    assert sorted(e["code"] for e in job.events("exit")) == [0, 0]
    assert not job.events("store_lost")
    assert not [n for n in others if "lost the rendezvous store" in n.text()]
    rounds = {e["cycle"]: e["nodes"] for e in job.events("rendezvous_done")}
    [spare] = {e["node"] for e in job.events("standby")}
    first = cycle0[0]["nodes"]
    assert max(rounds) == 1 and rounds[1] == [spare if n == name else n for n in first], rounds
    [named] = job.events("node_lost")
    assert (named["nodes"], named["lost_cycle"]) == ([name], 0), named
    assert (job.ckpt_dir / "FINISHED").exists(), "training did not finish"
    fault.back_to_work(job, killed_at, "agent killed to all workers running again")


@pytest.mark.backends("store", reason="only `ftrun store` is a store process to restart")
def test_the_store_process_restarted(fault: Fault):
    """`ftrun store` SIGKILLed and started again while 2 nodes train: each launcher says so in
    one log line, writes the job's state back, and the job restarts its cycle and finishes.
    The case has its own store (the session's must outlive every case)."""
    store = StoreProcess(fault.tmp / "store.log")
    try:
        # Cycle 0: 250 steps of 20 ms, long enough to lose the store in it.
        job = fault.light([], launcher_args=store.launcher_args)
        training(job)
        killed_at = store.restart()
        fault.expect = "recovered (state written back)"
        codes = job.wait(90)
    finally:
        store.stop()
        fault.pids.update(store.pids)
    fault.track(job)
    assert codes == [0, 0], "\n".join(n.text()[-2500:] for n in job.nodes)
    assert sorted(e["cycle"] for e in job.events("store_restarted")) == [0, 0]
    for node in job.nodes:
        own = agent_lines(node)
        assert len([line for line in own if "lost the rendezvous store" in line]) == 1, own
        assert not [line for line in own if "Traceback" in line], node.text()
    assert max(e["cycle"] for e in job.events("rendezvous_done")) == 1
    assert not job.events("store_lost")
    fault.back_to_work(job, killed_at, "store killed to all workers running again")


@matrix_only("test_launcher.py: a SIGTERM to one launcher preempts the whole job")
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


def agent_lines(node: Node) -> list[str]:
    """The launcher's own output, without its workers' lines (prefixed `[<role><rank>]:`)."""
    return [line for line in node.text().splitlines() if not line.startswith("[default")]


def _pid(event_node: str) -> int:
    return int(event_node.rsplit("-", 1)[1])
