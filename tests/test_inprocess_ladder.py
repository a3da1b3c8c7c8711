"""The in-process tier without processes: the ladder's decisions (`agent.inprocess.ladder`, the
policy's use of it), the one restart budget (`inprocess_protocol.RestartBudget`), the reports'
wire form, and the agent's link to the wrapped ranks (a real TCPStore on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
from torch.distributed import PrefixStore, TCPStore

from ftrun.agent.decisions import ladder
from ftrun.agent.decisions import policy as p
from ftrun.agent.decisions.policy import Action, Facts, Policy, RestartVote
from ftrun.agent.decisions.state import AgentState
from ftrun.agent.node_services.inprocess_link import InprocessLink
from ftrun.config.agent import AgentConfig
from ftrun.environment import Env
from ftrun.errors import ProtocolError
from ftrun.inprocess_protocol import (
    CURRENT_KEY,
    Interruption,
    Iteration,
    Report,
    ReportKind,
    RestartBudget,
)
from ftrun.rank_monitor import protocol as wire
from ftrun.rendezvous.ranks import Round

FACTS = Facts(node="n0", cycle=4, round_size=2, max_nodes=2)
HANG = p.HangsFound(ranks=(3,), pids=(103,), kind="heartbeat")
CAUSE = "rank(s) 3 on n0 hung (heartbeat)"
SPENT = "3 in-process restarts within 120s did not cure it (last: EXCEPTION: boom)"


def decide(event: p.AgentEvent, **facts: object) -> Action:
    return Policy(max_restarts=2).decide(AgentState.RUNNING, event,
                                         dataclasses.replace(FACTS, **facts))  # fmt: skip


@pytest.mark.parametrize(
    ("wrapped", "stopped", "spent", "rung"),
    [
        (True, False, None, ladder.Rung.IN_PROCESS),
        (True, False, SPENT, ladder.Rung.IN_JOB),  # the budget is spent
        (True, True, None, ladder.Rung.IN_JOB),  # a stopped rank runs no watcher
        (False, False, None, ladder.Rung.IN_JOB),  # nothing to interrupt
    ],
)
def test_the_first_rung_of_a_hang(wrapped: bool, stopped: bool, spent: str | None, rung) -> None:
    assert ladder.for_hang(wrapped, stopped, spent).rung is rung


def test_a_hang_of_wrapped_ranks_is_interrupted_in_process_without_a_stop_or_a_vote() -> None:
    assert decide(HANG, inprocess_wrapped=True) == Action(
        None, interrupt=p.InprocessInterrupt((3,), CAUSE)
    )


def test_a_hang_once_the_budget_is_spent_takes_the_in_job_restart_and_says_why() -> None:
    action = decide(HANG, inprocess_wrapped=True, inprocess_spent=SPENT)
    assert (action.next_state, action.kill, action.vote) == (
        AgentState.STOPPING, (103,), RestartVote(CAUSE)
    )  # fmt: skip
    assert action.interrupt is None and SPENT in (action.note or "")


def test_a_stopped_wrapped_rank_is_killed_and_the_job_restarts() -> None:
    action = decide(dataclasses.replace(HANG, stopped=True), inprocess_wrapped=True)
    assert action.kill == (103,) and action.interrupt is None


def test_unwrapped_ranks_keep_todays_behaviour() -> None:
    assert decide(HANG) == Action(AgentState.STOPPING, kill=(103,), vote=RestartVote(CAUSE))


def test_a_killed_wrapped_rank_is_replaced_and_a_wrapper_that_gave_up_is_not() -> None:
    killed = p.WorkerEnded(rank=1, returncode=-9, others_running=1)
    assert decide(killed, inprocess_wrapped=True).replace == p.RankReplacement(
        1, "rank 1 on n0 was killed by SIGKILL")  # fmt: skip
    gave_up = decide(dataclasses.replace(killed, returncode=1), inprocess_wrapped=True)
    assert gave_up.next_state is AgentState.STOPPING and gave_up.replace is None
    assert "wrapper gave up (exit 1)" in (gave_up.note or "")


def test_a_rung_that_could_not_be_carried_out_is_decided_again_as_the_in_job_restart() -> None:
    """The executor's failed effect is an event: the policy decides again, purely."""
    action = decide(p.RungFailed(HANG, "the wrapped ranks' store cannot be reached"),
                    inprocess_wrapped=True)  # fmt: skip
    assert (action.next_state, action.kill, action.vote) == (
        AgentState.STOPPING, (103,), RestartVote(CAUSE)
    )  # fmt: skip
    assert "store cannot be reached: in-job restart" in (action.note or "")


# ---- the budget ---------------------------------------------------------------------------


def test_the_budget_counts_restarts_within_its_window() -> None:
    budget = RestartBudget(max_restarts=3, window_s=120.0, same_in_a_row=0)
    assert budget.exceeded([10.0, 20.0], ["a", "b", "c"], now=30.0) is None
    why = budget.exceeded([10.0, 20.0, 25.0], ["a", "b", "c", "d"], now=30.0)
    assert why is not None and "3 in-process restarts within 120s" in why and "last: d" in why
    assert budget.exceeded([10.0, 20.0, 25.0], ["a", "b", "c", "d"], now=131.0) is None
    assert RestartBudget(0, 120.0, 0).exceeded([1.0] * 100, ["x"] * 100, now=2.0) is None


def test_the_same_fault_in_a_row_is_escalated_at_once_naming_it() -> None:
    budget = RestartBudget(max_restarts=0, window_s=1.0, same_in_a_row=3)
    same = "EXCEPTION: AttributeError: 'NoneType' object has no attribute 'iteration'"
    assert budget.exceeded([], [same, same], now=0.0) is None
    assert budget.exceeded([], ["other", same, same], now=0.0) is None
    assert budget.exceeded([], [same, same, same], now=0.0) == (
        f"the same fault ended 3 iterations in a row: {same}")  # fmt: skip


def test_the_budget_travels_in_one_variable_and_a_bad_one_is_one_line() -> None:
    budget = RestartBudget(5, 60.0, 2)
    assert RestartBudget.from_env({Env.INPROCESS_BUDGET: budget.to_env()}) == budget
    assert RestartBudget.from_env({}) is None
    for bad in ("3/120", "x/1/1", "-1/120/3", "3/0/3"):
        with pytest.raises(ValueError, match=Env.INPROCESS_BUDGET.value):
            RestartBudget.from_env({Env.INPROCESS_BUDGET: bad})


def test_the_launch_config_declares_the_budget_once() -> None:
    from ftrun.ft_launcher.build import build_config

    config = build_config(["--nnodes=1", "--ft-inprocess-max-restarts=5",
                           "--ft-inprocess-restart-window=30", "--ft-max-same-failure=2",
                           "train.py"], {Env.INPROCESS_ABORT_TIMEOUT.value: "7"})  # fmt: skip
    assert config.agent.inprocess_budget == RestartBudget(5, 30.0, 2)
    assert config.agent.inprocess_abort_timeout == 7.0  # the variable is the option's alias


# ---- the reports' wire --------------------------------------------------------------------


def test_a_report_round_trips_on_the_monitor_wire() -> None:
    cause = Interruption(1, "EXCEPTION", "ValueError: boom", 12.5)
    for report in (Report(ReportKind.WRAPPED, 4, address="127.0.0.1:5", prefix="p/4"),
                   Report(ReportKind.RECOVERED, 4, 2, cause=cause, seconds=0.25),
                   Report(ReportKind.GAVE_UP, None, 7, why="spent")):  # fmt: skip
        note = wire.InprocessNote(3, 1234, report)
        assert wire.decode(wire.encode(note)) == note


def test_a_long_text_is_cut_not_refused() -> None:
    long = Report(ReportKind.RECOVERED, 4, cause=Interruption(1, "K" * 40, "w" * 900, 1.0),
                  why="x" * 900)  # fmt: skip
    decoded = wire.decode(wire.encode(wire.InprocessNote(3, 1234, long))).report
    assert decoded.cause is not None and len(decoded.cause.why) == 500
    assert len(decoded.why) == 500 and len(decoded.cause.kind) == 32


@pytest.mark.parametrize(
    "bad",
    [
        ["nope", 4, 0, "", None, None, "", ""],  # an unknown kind
        ["left", 4, -1, "", None, None, "", ""],  # a negative iteration
        ["left", 4, 0, "x" * 501, None, None, "", ""],  # too long
        ["recovered", 4, 0, "", [1, "E", "w"], None, "", ""],  # a short cause
        ["recovered", 4, 0, "", None, float("nan"), "", ""],  # not a number of seconds
        ["left", 4, 0, ""],  # too few fields
    ],
)
def test_a_malformed_report_is_refused(bad: list) -> None:
    import msgpack

    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb([1, "ip", 3, 1234, bad]))


# ---- the agent's link ---------------------------------------------------------------------


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=5))  # fmt: skip


def link_of(store: object, events: list) -> InprocessLink:
    config = AgentConfig(("train.py",), inprocess_max_restarts=2, max_same_failure=3)
    return InprocessLink(store, config, "job", lambda name, **f: events.append((name, f)))


def note(kind: ReportKind, cycle: int = 4, **fields: object) -> wire.InprocessNote:
    return wire.InprocessNote(0, 100, Report(kind, cycle, **fields))


def test_the_link_hands_the_ranks_the_store_the_prefix_and_the_budget(store: TCPStore) -> None:
    env = link_of(store, []).worker_env(Round(number=4, nodes=(), group_rank=0))
    assert env == {Env.INPROCESS_STORE: f"127.0.0.1:{store.port}",
                   Env.INPROCESS_PREFIX: "inprocess/job/4",
                   Env.INPROCESS_BUDGET: "2/120/3", Env.INPROCESS_ABORT_TIMEOUT: "30"}  # fmt: skip


def test_reports_make_events_once_per_iteration_and_spend_the_budget(store: TCPStore) -> None:
    events: list = []
    link = link_of(store, events)
    assert not link.wrapped()
    link.take(note(ReportKind.WRAPPED, cycle=3, address="a:1"), cycle=4)  # an older cycle's
    assert not link.wrapped()
    link.take(note(ReportKind.WRAPPED, address=f"127.0.0.1:{store.port}", prefix="p"), cycle=4)
    assert link.wrapped() and link.spent() is None
    cause = Interruption(1, "EXCEPTION", "boom", 1.0)
    for iteration in (0, 0, 1):  # every local rank reports each restart
        link.take(note(ReportKind.RECOVERED, iteration=iteration, cause=cause, seconds=0.1), 4)
    assert [kind for kind, _ in events] == ["inprocess_recovered"] * 2
    assert events[0][1] == {"iteration": 0, "kind": "EXCEPTION", "from_rank": 1, "why": "boom",
                            "seconds": 0.1}  # fmt: skip
    assert "2 in-process restarts" in (link.spent() or "")
    link.take(note(ReportKind.GAVE_UP, iteration=2, why="spent"), 4)
    assert events[-1] == ("inprocess_gave_up", {"rank": 0, "iteration": 2, "why": "spent"})
    link.on_stopped(None, ())  # a new cycle: new processes, a fresh budget
    assert not link.wrapped() and link.spent() is None


def test_the_agent_interrupts_the_ranks_newest_iteration_through_its_own_client(
    store: TCPStore,
) -> None:
    link = link_of(store, [])
    assert not link.interrupt((3,), "UNRESPONSIVE", CAUSE)  # nobody said they wrap
    link.take(note(ReportKind.WRAPPED, address=f"127.0.0.1:{store.port}", prefix="pfx"), 4)
    ranks = PrefixStore("pfx", store)
    ranks.set(CURRENT_KEY, "2")
    assert link.interrupt((3,), "UNRESPONSIVE", CAUSE)
    iteration = Iteration(ranks, 2, world_size=4)
    assert iteration.wait_end(datetime.timedelta(seconds=1)) and iteration.was_interrupted()
    [record] = iteration.interruptions()
    assert (record.rank, record.kind, record.why) == (3, "UNRESPONSIVE", CAUSE)
    assert link._client is None  # the agent's own store: no new connection


def test_unreachable_ranks_are_reported_so_that_the_agent_escalates(store: TCPStore) -> None:
    link = link_of(store, [])
    link.take(note(ReportKind.WRAPPED, address="127.0.0.1:1", prefix="x"), 4)  # their own store
    assert not link.interrupt((3,), "UNRESPONSIVE", CAUSE)
