"""The in-process ladder's decisions (`agent.inprocess.ladder`, the policy's use of it) without
processes, and the agent's link to the wrapped ranks' store (a real TCPStore on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from ftrun.agent import policy as p
from ftrun.agent.inprocess import ladder
from ftrun.agent.inprocess.link import Coordination
from ftrun.agent.policy import Action, Facts, Policy, RestartVote
from ftrun.agent.state import AgentState
from ftrun.inprocess.events import EventWriter
from ftrun.inprocess.iteration import CURRENT_KEY, Iteration

FACTS = Facts(node="n0", cycle=4, round_size=2, max_nodes=2)
HANG = p.HangsFound(ranks=(3,), pids=(103,), kind="heartbeat")
CAUSE = "rank(s) 3 on n0 hung (heartbeat)"


def decide(event: p.HangsFound, **facts: object) -> Action:
    return Policy(max_restarts=2).decide(AgentState.RUNNING, event,
                                         dataclasses.replace(FACTS, **facts))  # fmt: skip


@pytest.mark.parametrize(
    ("wrapped", "stopped", "attempts", "rung"),
    [
        (True, False, 0, ladder.Rung.IN_PROCESS),
        (True, False, ladder.MAX_ATTEMPTS - 1, ladder.Rung.IN_PROCESS),
        (True, False, ladder.MAX_ATTEMPTS, ladder.Rung.IN_JOB),  # it did not cure it
        (True, True, 0, ladder.Rung.IN_JOB),  # a stopped rank runs no watcher
        (False, False, 0, ladder.Rung.IN_JOB),  # nothing to interrupt
    ],
)
def test_the_first_rung_of_a_hang(wrapped: bool, stopped: bool, attempts: int, rung) -> None:
    assert ladder.for_hang(wrapped, stopped, attempts).rung is rung


def test_a_hang_of_wrapped_ranks_is_interrupted_in_process_without_a_stop_or_a_vote() -> None:
    assert decide(HANG, inprocess_wrapped=True) == Action(
        None, interrupt=p.InprocessInterrupt((3,), CAUSE)
    )


def test_a_hang_that_in_process_restarts_did_not_cure_takes_the_in_job_restart() -> None:
    action = decide(HANG, inprocess_wrapped=True, inprocess_attempts=ladder.MAX_ATTEMPTS)
    assert (action.next_state, action.kill, action.vote) == (
        AgentState.STOPPING, (103,), RestartVote(CAUSE)
    )  # fmt: skip
    assert action.interrupt is None and "did not cure it" in (action.note or "")


def test_a_stopped_wrapped_rank_is_killed_and_the_job_restarts() -> None:
    action = decide(dataclasses.replace(HANG, stopped=True), inprocess_wrapped=True)
    assert action.kill == (103,) and action.interrupt is None


def test_unwrapped_ranks_keep_todays_behaviour() -> None:
    assert decide(HANG) == Action(AgentState.STOPPING, kill=(103,), vote=RestartVote(CAUSE))


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=5))  # fmt: skip


def test_the_agent_interrupts_the_ranks_newest_iteration_through_their_store(
    tmp_path: Path, store: TCPStore
) -> None:
    writer = EventWriter.for_rank(0, {"FTRUN_IPC_DIR": str(tmp_path)})
    writer.announce(f"127.0.0.1:{store.port}", "pfx", "4")
    writer.close()
    ranks = PrefixStore("pfx", store)
    ranks.set(CURRENT_KEY, "2")
    link = Coordination(tmp_path)
    assert link.current(4) is not None and link.current(5) is None  # another cycle's ranks
    assert link.interrupt(4, (3,), "UNRESPONSIVE", CAUSE)
    iteration = Iteration(ranks, 2, world_size=4)
    assert iteration.wait_end(datetime.timedelta(seconds=1)) and iteration.was_interrupted()
    [record] = iteration.interruptions()
    assert (record.rank, record.kind, record.why) == (3, "UNRESPONSIVE", CAUSE)
    assert link.recent_attempts(60.0) == 1


def test_unreachable_ranks_are_reported_so_that_the_agent_escalates(tmp_path: Path) -> None:
    folder = tmp_path / "inprocess"
    folder.mkdir()
    (folder / "coordination.json").write_text(
        json.dumps({"address": "127.0.0.1:1", "prefix": "x", "cycle": "4"})
    )
    assert not Coordination(tmp_path).interrupt(4, (3,), "UNRESPONSIVE", CAUSE)
    assert Coordination(tmp_path).recent_attempts(60.0) == 0
