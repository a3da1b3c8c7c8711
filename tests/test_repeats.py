"""The restart policy that learns: every transition of a failure judged against the job's
history (`agent.repeats`, applied by `agent.policy`), without processes or a store."""

from __future__ import annotations

import dataclasses

from ftrun.agent import policy as p
from ftrun.agent.attribution import Kind, Signature, health_signature
from ftrun.agent.policy import Action, Facts, Outcome, Policy, RestartVote
from ftrun.agent.repeats import Decision, judge
from ftrun.agent.state import TRANSITIONS, AgentState
from ftrun.errors import ExitCode
from ftrun.rendezvous.control import FailureRecord

S = AgentState
BUG = Signature(Kind.EXCEPTION, "ValueError", where="train.py:42 in step")
OTHER = Signature(Kind.CUDA, "CUDA error: an illegal memory access was encountered")
PEER = Signature(Kind.PEER_LOST, "RuntimeError", secondary=True)
XID = health_signature("Xid 79", "GPU 3")
FACTS = Facts(node="n1", cycle=5, round_size=2, max_nodes=2, can_lose_node=True)


def history(*records: tuple[int, str, Signature]) -> tuple[FailureRecord, ...]:
    return tuple(FailureRecord(cycle, node, sig.key) for cycle, node, sig in records)


def decide(event: p.AgentEvent, policy: Policy | None = None, **facts: object) -> Action:
    action = (policy or Policy(max_restarts=10)).decide(
        S.RUNNING, event, dataclasses.replace(FACTS, **facts)
    )
    if action.next_state is not None:
        assert action.next_state in TRANSITIONS[S.RUNNING]
    return action


def crash(signature: Signature | None) -> p.WorkerEnded:
    return p.WorkerEnded(rank=2, returncode=1, others_running=1, signature=signature)


# ---- judge -------------------------------------------------------------------------------------


def test_a_first_failure_restarts() -> None:
    assert judge(BUG, "n1", 5, (), 3, True).decision is Decision.RESTART


def test_the_same_failure_in_n_cycles_on_n_nodes_stops_the_job() -> None:
    past = history((1, "n0", BUG), (2, "n2", BUG))
    found = judge(BUG, "n1", 5, past, 3, True)
    assert found.decision is Decision.STOP
    assert "the same failure in 3 cycles on 3 nodes (n0, n1, n2)" in found.reason
    assert BUG.key in found.reason and "--ft-max-same-failure=3" in found.reason


def test_one_cycle_is_one_incident_however_many_nodes_failed_in_it() -> None:
    past = history((1, "n0", BUG), (1, "n2", BUG), (1, "n3", BUG))
    assert judge(BUG, "n1", 1, past, 3, True).decision is Decision.RESTART
    assert judge(BUG, "n1", 2, past, 3, True).decision is Decision.RESTART


def test_the_same_node_in_every_cycle_is_not_n_nodes() -> None:
    past = history((1, "n0", BUG), (2, "n1", BUG), (3, "n0", OTHER))
    assert judge(BUG, "n0", 4, past, 3, False).decision is Decision.RESTART


def test_a_node_whose_last_two_failures_look_alike_leaves() -> None:
    past = history((1, "n1", OTHER), (3, "n0", BUG))
    assert judge(OTHER, "n1", 5, past, 3, True).decision is Decision.EXCLUDE


def test_alike_but_not_in_a_row_restarts() -> None:
    past = history((1, "n1", OTHER), (2, "n1", BUG))
    assert judge(OTHER, "n1", 5, past, 3, True).decision is Decision.RESTART


def test_a_failure_shared_with_other_nodes_is_not_the_nodes_fault() -> None:
    past = history((1, "n1", OTHER), (1, "n0", OTHER))
    assert judge(OTHER, "n1", 2, past, 3, True).decision is Decision.RESTART
    now = history((1, "n1", OTHER), (2, "n0", OTHER))
    assert judge(OTHER, "n1", 2, now, 3, True).decision is Decision.RESTART


def test_a_node_the_job_cannot_lose_stays_and_says_why() -> None:
    found = judge(OTHER, "n1", 5, history((1, "n1", OTHER)), 3, can_lose_node=False)
    assert found.decision is Decision.RESTART
    assert "stays: no standby node waits" in found.reason


def test_consequences_of_another_failure_are_never_counted() -> None:
    past = history((1, "n0", PEER), (2, "n1", PEER), (3, "n2", PEER))
    assert judge(PEER, "n1", 5, past, 3, True).decision is Decision.RESTART


def test_the_job_stop_is_off_at_zero_and_wins_over_the_exclusion() -> None:
    past = history((1, "n1", BUG))
    assert judge(BUG, "n1", 2, past, 0, True).decision is Decision.EXCLUDE
    assert judge(BUG, "n1", 2, history((1, "n0", BUG)), 2, True).decision is Decision.STOP


# ---- the policy's transitions ----------------------------------------------------------------


def test_a_named_crash_restarts_and_is_recorded() -> None:
    action = decide(crash(BUG))
    cause = f"rank 2 on n1 exited with code 1: {BUG.key}"
    assert action == Action(S.STOPPING, vote=RestartVote(cause), record=BUG)


def test_an_unnamed_crash_restarts_as_before() -> None:
    assert decide(crash(None)) == Action(S.STOPPING, vote=RestartVote("rank 2 on n1 exited with "
                                                                       "code 1"))  # fmt: skip


def test_a_crash_seen_on_n_nodes_shuts_the_job_down_not_relaunched() -> None:
    action = decide(crash(BUG), history=history((1, "n0", BUG), (3, "n2", BUG)), cycle=5)
    assert action.next_state is S.STOPPING and action.record == BUG
    assert action.shutdown is not None
    assert action.shutdown.code is ExitCode.REPEATED_FAILURE


def test_a_node_failing_twice_the_same_way_leaves_with_excluded() -> None:
    action = decide(crash(OTHER), history=history((2, "n1", OTHER)))
    assert action.leave is not None and "failed the same way twice" in action.leave
    assert action.vote == RestartVote(action.leave)  # a failure: it spends the budget
    assert action.outcome == Outcome(ExitCode.EXCLUDED, action.leave)


def test_a_node_that_must_stay_restarts_with_a_note() -> None:
    action = decide(crash(OTHER), history=history((2, "n1", OTHER)), can_lose_node=False)
    assert action.leave is None and action.vote is not None
    assert action.note is not None and "stays" in action.note


def test_a_hang_is_judged_like_a_crash_and_its_ranks_killed() -> None:
    hang = p.HangsFound((2,), (99,), "heartbeat", Signature(Kind.HANG, "heartbeat"))
    action = decide(hang)
    assert action.kill == (99,) and action.record == hang.signature and action.vote is not None


# ---- health while training ---------------------------------------------------------------------


def test_a_health_fault_excludes_the_node_at_once() -> None:
    action = decide(p.HealthFound(XID, fault=True))
    assert action.next_state is S.STOPPING and action.record == XID
    assert action.leave == "node n1 excluded: health: Xid 79"
    assert action.outcome == Outcome(ExitCode.EXCLUDED, action.leave)


def test_a_health_fault_on_a_node_the_job_needs_is_logged() -> None:
    action = decide(p.HealthFound(XID, fault=True), can_lose_node=False)
    assert action.next_state is None and action.vote is None
    assert action.note is not None and "the node stays" in action.note


def test_a_health_fault_restarts_under_restart() -> None:
    action = decide(p.HealthFound(XID, fault=True), Policy(10, health_action="restart"))
    assert action.vote is not None and action.leave is None and action.record == XID


def test_health_action_log_and_degradations_only_log() -> None:
    logged = decide(p.HealthFound(XID, fault=True), Policy(10, health_action="log"))
    assert logged.next_state is None and logged.note is not None and logged.record is None
    hot = health_signature("hardware thermal slowdown", "GPU 0")
    assert decide(p.HealthFound(hot, fault=False)).next_state is None
