"""Hot spare nodes, progress tracking and workers' control requests, with real launchers.

Several `ft_launcher`s on 127.0.0.1 run one job with fewer `--nnodes` than launchers: the extra
ones stand by. A "node" lost is its launcher's whole process group SIGKILLed (the agent and its
workers, as when a machine dies); the store host is never the one killed (the job's store lives
in its agent, as torchrun's c10d store does).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.errors import ExitCode
from launch import Job, Node, node_of, start_job
from support import wait_for

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent
CONTROL = ROOT / "workers" / "control_worker.py"
FAULT = ROOT / "workers" / "fault_worker.py"
PROMPT_EXIT_S = 15.0
"""Every launcher is gone this soon after the job ended (nobody waits for a rendezvous timeout)."""
SPARE = ["--nnodes=2", "--max-restarts=3", "--rdzv-conf=last_call_timeout=5"]


def rounds(job: Job) -> dict[int, list[str]]:
    """cycle -> node names of its round, in group-rank order (as every node saw it)."""
    seen: dict[int, list[str]] = {}
    for event in job.events("rendezvous_done"):
        assert seen.setdefault(event["cycle"], event["nodes"]) == event["nodes"]
    return seen


def standby_nodes(job: Job, cycle: int) -> set[str]:
    return {e["node"] for e in job.events("standby") if e["cycle"] == cycle}


def killable(job: Job, cycle: int) -> Node:
    """An active node of `cycle` that does not host the store."""
    hosts = {e["node"] for e in job.events("rendezvous_done") if e.get("store_host")}
    name = next(n for n in rounds(job)[cycle] if n not in hosts)
    return node_of(job, name)


def lose(node: Node) -> None:
    """The machine dies: its agent and its workers (the launcher's process group) at once."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.proc.pid, signal.SIGKILL)
    node.proc.wait(10)


def wait_all(job: Job, timeout: float) -> dict[int, int]:
    return dict(zip((n.index for n in job.nodes), job.wait(timeout), strict=True))


def exit_times(job: Job) -> list[float]:
    return [e["ts"] for e in job.events("exit")]


def finished(job: Job, ranks: int = 2, cycle: int = 1) -> bool:
    """Every rank of the light script made its last step, in `cycle`."""
    done = [job.ckpt_dir / f"done-rank{rank}" for rank in range(ranks)]
    return all(path.exists() and path.read_text() == f"{cycle}\n" for path in done)


def test_a_crash_restarts_on_the_same_nodes_with_the_same_group_ranks(tmp_path: Path):
    # The light script (no torch: the rounds and the standby are the point): rank 1 exits 1 at
    # step 10 of cycle 0, once the standby stood by in cycle 0.
    job = start_job(
        tmp_path, 3, [*SPARE], ["--steps", "30", "--exit", "0:1:10:1", "--fault-after", "standby"],
        script=FAULT,
    )  # fmt: skip
    wait_for(lambda: standby_nodes(job, 0), 90, "a node standing by in cycle 0")
    job.ckpt_dir.mkdir(parents=True, exist_ok=True)
    (job.ckpt_dir / "standby").write_text("")
    codes = wait_all(job, 120)
    assert codes == {0: 0, 1: 0, 2: 0}
    seen = rounds(job)
    assert len(seen) == 2 and seen[0] == seen[1]  # same nodes, same order
    standby = standby_nodes(job, 0) & standby_nodes(job, 1)
    assert len(standby) == 1 and standby.isdisjoint(seen[0])
    # The round lists the standby nodes that had arrived when it closed; the report, all.
    assert set(job.events("rendezvous_done")[-1]["standby"]) <= standby
    text = subprocess.run(
        [sys.executable, "-m", "ftrun.tools.cli", "report", "--no-timeline", str(job.log_dir)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert f"{standby.pop()}" in text and "stood by as a hot spare in cycle(s) 0-1" in text
    assert finished(job)
    ends = exit_times(job)
    assert max(ends) - min(ends) < PROMPT_EXIT_S


def test_a_node_lost_while_the_ranks_never_talk_is_found_by_its_neighbour(tmp_path: Path):
    """Ranks that never talk to each other: no collective fails when a node dies with its
    workers (as over NCCL, where the survivors wait for the dead peer), so only the neighbour
    watch finds the loss. The survivor restarts with the spare, which trains to the end."""
    envs = [{"GROUP_RANK": str(i)} for i in range(3)]
    job = start_job(
        tmp_path, 3, [*SPARE, "--ft-use-infra-group-rank", "--workers-stop-timeout=1"],
        ["--first-cycle-steps", "100000", "--steps", "20", "--step-time", "0.05"], script=FAULT,
        node_env=envs,
    )  # fmt: skip
    wait_for(lambda: len(job.progress(0)) >= 5, 90, "training on 2 nodes")
    victim = killable(job, 0)
    lose(victim)
    codes = wait_all(job, 90)
    assert codes == {n.index: -signal.SIGKILL if n is victim else 0 for n in job.nodes}
    spare = standby_nodes(job, 0).pop()
    assert spare in rounds(job)[1]
    survivor = next(n for n in job.nodes if n is not victim and node_of(job, spare) is not n)
    text = survivor.text()
    assert "did not answer 3 probes in a row" in text and "stopped answering while" in text, text


def test_two_spares_take_the_slots_of_two_successive_losses(tmp_path: Path):
    # Infra group ranks (GROUP_RANK), the nodes started in reverse: the lowest two are active
    # whatever the arrival order, the other two stand by.
    envs = [{"GROUP_RANK": str(i)} for i in range(4)]
    job = start_job(
        tmp_path, 4, [*SPARE, "--ft-use-infra-group-rank"],
        ["--steps", "80", "--step-time", "0.05"], node_env=envs, order=[3, 2, 1, 0],
    )  # fmt: skip
    wait_for(lambda: len(job.progress(0)) >= 5, 90, "training on 2 nodes")
    assert [node_of(job, n).index for n in rounds(job)[0]] == [0, 1]
    assert {node_of(job, n).index for n in standby_nodes(job, 0)} == {2, 3}
    losses = []  # (node, its name, the cycle it was lost in)
    for loss in range(2):
        cycle = max(rounds(job))
        victim = killable(job, cycle)
        losses.append((victim, next(n for n in rounds(job)[cycle] if node_of(job, n) is victim),
                       cycle))  # fmt: skip
        lose(victim)
        wait_for(lambda c=cycle: max(rounds(job)) > c, 60, f"a round after loss {loss + 1}")
        steps = len(job.progress(0))
        wait_for(lambda s=steps: len(job.progress(0)) > s + 3, 60, "training again")
    codes = wait_all(job, 180)
    lost = [node for node, _, _ in losses]
    assert codes == {n.index: -signal.SIGKILL if n in lost else 0 for n in job.nodes}
    seen = rounds(job)
    # The survivor keeps its group rank; a spare of the round lost takes the lost node's.
    nexts = [cycle for _, _, cycle in losses[1:]] + [max(seen)]
    for (_, name, cycle), after in zip(losses, nexts, strict=True):
        [spare] = set(seen[after]) - set(seen[cycle])
        assert spare in standby_nodes(job, cycle)
        assert seen[after] == [spare if n == name else n for n in seen[cycle]]
    final = {node_of(job, n).index for n in seen[max(seen)]}
    assert len(final) == 2 and final.isdisjoint(n.index for n in lost)
    assert (job.ckpt_dir / "FINISHED").exists()
    # Each lost node is named as the cause, the survivor's gloo errors as its consequence.
    named = sorted((e["lost_cycle"], e["nodes"]) for e in job.events("node_lost"))
    assert named == [(cycle, [name]) for _, name, cycle in losses]
    assert all(f.get("secondary") for f in job.failures())
    report = job.report()
    assert all(f"node {name} lost" in report for _, name, _ in losses)
    ends = exit_times(job)
    assert max(ends) - min(ends) < PROMPT_EXIT_S


def test_cycles_without_progress_stop_the_job_with_their_own_code(tmp_path: Path):
    # Every cycle fails the same way too: the repeated-failure stop (3 in a row) is off here.
    args = ["--max-restarts=9", "--ft-max-no-progress-cycles=2", "--ft-max-same-failure=0"]
    job = start_job(tmp_path, 2, args, ["--stall-at", "4", "--step-time", "0.02"], script=CONTROL)
    codes = wait_all(job, 120)
    assert codes == {0: ExitCode.NO_PROGRESS, 1: ExitCode.NO_PROGRESS}
    # cycle 0 reached iteration 3, cycles 1 and 2 got no further: the round of cycle 3 stops
    assert max(rounds(job)) == 3
    reasons = {e["why"] for e in job.events("exit")}
    assert len(reasons) == 1 and "2 cycles in a row made no progress" in reasons.pop()


def test_a_worker_excludes_its_node_and_the_spare_takes_over(tmp_path: Path):
    job = start_job(
        tmp_path, 3, [*SPARE], ["--request", "ExcludeThisNode:0:1:5", "--steps", "40"],
        script=CONTROL,
    )  # fmt: skip
    codes = wait_all(job, 120)
    first = rounds(job)[0]
    excluded = node_of(job, first[1])
    assert codes == {n.index: ExitCode.EXCLUDED if n is excluded else 0 for n in job.nodes}
    assert rounds(job)[1][0] == first[0] and excluded.index not in {
        node_of(job, n).index for n in rounds(job)[1]
    }
    assert job.events("control_request")[0]["action"] == "ExcludeThisNode"
    assert (job.ckpt_dir / "FINISHED").exists()


def test_a_node_with_a_nic_port_down_is_replaced(tmp_path: Path):
    roots = [tmp_path / f"ib{i}" for i in range(3)]
    for root in roots:
        port = root / "mlx5_0" / "ports" / "1"
        (port / "counters").mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "phys_state").write_text("5: LinkUp\n")
        (port / "counters" / "link_downed").write_text("0\n")
    job = start_job(
        # The check before each round (the watch while training is test_health_watch's). The
        # light script (no torch): rank 0 exits 1 at step 30 once the port is down.
        tmp_path, 3, [*SPARE, "--ft-enable-nic-healthcheck", "--ft-health-interval=0"],
        ["--steps", "60", "--step-time", "0.1", "--exit", "0:0:30:1", "--fault-after", "down"],
        node_env=[{"FTRUN_NIC_SYSFS_ROOT": str(root)} for root in roots], script=FAULT,
    )  # fmt: skip
    wait_for(lambda: len(job.progress(0)) >= 3, 90, "training on 2 nodes")
    first = rounds(job)[0]
    victim = killable(job, 0)
    # Its port goes down; rank 0 exits later: the node fails the check before the restart.
    (roots[victim.index] / "mlx5_0" / "ports" / "1" / "state").write_text("1: DOWN\n")
    (job.ckpt_dir / "down").write_text("")
    codes = wait_all(job, 120)
    assert codes == {n.index: ExitCode.DO_NOT_RELAUNCH if n is victim else 0 for n in job.nodes}
    assert rounds(job)[1] == [
        standby_nodes(job, 0).pop() if node_of(job, n) is victim else n for n in first
    ]
    assert "mlx5_0" in next(e["reason"] for e in job.events("unhealthy"))
    assert finished(job)
