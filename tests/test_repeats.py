"""The restart policy that learns: every transition of a failure judged against the job's
history (`agent.diagnosis.repeats`, applied by `agent.policy`), without processes or a store."""

from __future__ import annotations

import dataclasses
import json

from torch.distributed import HashStore

from ftrun.agent.decisions import policy as p
from ftrun.agent.decisions.attribution import Kind, Signature, health_signature
from ftrun.agent.decisions.policy import Action, Facts, Outcome, Policy, RestartVote
from ftrun.agent.decisions.repeats import Decision, judge
from ftrun.agent.decisions.state import TRANSITIONS, AgentState
from ftrun.errors import ExitCode
from ftrun.rendezvous.control import FailureRecord, job_control
from ftrun.rendezvous.ranks import NodeDescriptor, Round

S = AgentState
BUG = Signature(Kind.EXCEPTION, "ValueError", where="train.py:42 in step")
OTHER = Signature(Kind.CUDA, "CUDA error: an illegal memory access was encountered")
PEER = Signature(Kind.PEER_LOST, "RuntimeError", secondary=True)
XID = health_signature("Xid 79", "GPU 3")
FACTS = Facts(node="n1", cycle=5, round_size=2, max_nodes=2, can_lose_node=True)


def history(*records: tuple) -> tuple[FailureRecord, ...]:
    """(cycle, node, signature[, ranks]) tuples as the job's history."""
    return tuple(FailureRecord(c, n, sig.key, *where) for c, n, sig, *where in records)


def decide(event: p.AgentEvent, policy: Policy | None = None, **facts: object) -> Action:
    action = (policy or Policy(max_restarts=10)).decide(
        S.RUNNING, event, dataclasses.replace(FACTS, **facts)
    )
    if action.next_state is not None:
        assert action.next_state in TRANSITIONS[S.RUNNING]
    return action


def crash(signature: Signature | None) -> p.WorkerEnded:
    return p.WorkerEnded(rank=2, returncode=1, others_running=1, signature=signature)


def run_cycles(nodes: dict[str, range], failing: list[list[str]], standby: bool) -> list[Action]:
    """Every cycle, each node of `failing[cycle]` (in order) fails with BUG holding its ranks in
    `nodes`; the executor's record is added to the history as `node.NodeAgent._apply` does."""
    past: list[FailureRecord] = []
    actions = []
    for cycle, failed in enumerate(failing):
        for node in failed:
            facts = dataclasses.replace(
                FACTS, node=node, cycle=cycle, round_size=len(nodes), max_nodes=len(nodes),
                history=tuple(past), can_lose_node=standby, ranks=nodes[node],
            )  # fmt: skip
            action = Policy(max_restarts=10).decide(S.RUNNING, crash(BUG), facts)
            actions.append(action)
            past.append(FailureRecord(cycle, node, BUG.key, nodes[node]))
            if action.shutdown is not None or action.leave is not None:
                return actions
    return actions


# ---- judge: the same failure in cycles in a row ------------------------------------------------


def test_a_first_failure_restarts() -> None:
    assert judge(BUG, "n1", 5, (), 3, True).decision is Decision.RESTART


def test_one_node_failing_the_same_way_in_n_cycles_in_a_row_stops_the_job() -> None:
    past = history((0, "n0", BUG), (1, "n0", BUG))
    found = judge(BUG, "n0", 2, past, 3, False)
    assert found.decision is Decision.STOP
    assert "the same failure in 3 cycles on 1 node (n0), in a row" in found.reason
    assert BUG.key in found.reason and "--ft-max-same-failure=3" in found.reason
    assert judge(BUG, "n0", 1, past[:1], 3, False).decision is Decision.RESTART


def test_two_nodes_failing_together_every_cycle_stop_at_the_nth_cycle() -> None:
    past = history((0, "n0", BUG), (0, "n1", BUG), (1, "n1", BUG), (1, "n0", BUG))
    found = judge(BUG, "n1", 2, past, 3, True)
    assert found.decision is Decision.STOP
    assert "the same failure in 3 cycles on 2 nodes (n0, n1), in a row" in found.reason


def test_one_cycle_is_one_incident_however_many_nodes_failed_in_it() -> None:
    past = history((1, "n0", BUG), (1, "n2", BUG), (1, "n3", BUG))
    assert judge(BUG, "n1", 1, past, 3, True).decision is Decision.RESTART
    assert judge(BUG, "n1", 2, past, 3, True).decision is Decision.RESTART


def test_a_cycle_that_failed_another_way_breaks_the_run() -> None:
    past = history((0, "n0", BUG), (1, "n0", OTHER), (2, "n0", BUG))
    assert judge(BUG, "n0", 3, past, 3, False).decision is Decision.RESTART
    again = (*past, *history((3, "n0", BUG)))
    assert judge(BUG, "n0", 4, again, 3, False).decision is Decision.STOP


def test_a_cycle_that_also_failed_another_way_still_counts() -> None:
    past = history((0, "n0", BUG), (1, "n1", OTHER), (1, "n0", BUG))
    assert judge(BUG, "n1", 2, past, 3, True).decision is Decision.STOP


def test_a_cycle_that_recorded_no_failure_neither_counts_nor_breaks_the_run() -> None:
    # Cycle 1 ended by a scale-up, a lost node, or only consequences of a failure elsewhere.
    past = history((0, "n0", BUG), (2, "n0", BUG))
    assert judge(BUG, "n0", 3, past, 3, False).decision is Decision.STOP
    assert judge(BUG, "n0", 3, past, 4, False).decision is Decision.RESTART


def test_a_cycle_that_trained_past_the_jobs_best_iteration_breaks_the_run() -> None:
    # The same transient fault hours of training apart: cycle 2 got past the job's best
    # iteration (round 3 says no stalled cycle before it), so the run is cycles 2-3.
    past = history((0, "n0", BUG), (1, "n0", BUG), (2, "n0", BUG))
    assert judge(BUG, "n0", 3, past, 3, False, stalled=0).decision is Decision.RESTART
    assert judge(BUG, "n0", 3, past, 3, False, stalled=1).decision is Decision.STOP
    assert judge(BUG, "n0", 3, past, 3, False, stalled=None).decision is Decision.STOP
    # A bug at the same step: the first cycle set the job's best, the next ones stalled.
    assert judge(BUG, "n0", 2, past[:2], 3, False, stalled=1).decision is Decision.STOP


def test_the_policy_cuts_the_run_only_for_a_job_that_reports_iterations() -> None:
    past = history((0, "n0", BUG), (1, "n0", BUG), (2, "n0", BUG))
    progressed = decide(crash(BUG), node="n0", cycle=3, history=past, can_lose_node=False,
                        stalled_cycles=0, progress_known=True)  # fmt: skip
    assert progressed.shutdown is None and progressed.vote is not None
    silent = decide(crash(BUG), node="n0", cycle=3, history=past, can_lose_node=False,
                    stalled_cycles=0, progress_known=False)  # fmt: skip
    assert silent.shutdown is not None
    assert silent.shutdown.code == ExitCode.REPEATED_FAILURE


def test_consequences_of_another_failure_are_never_counted() -> None:
    past = history((1, "n0", PEER), (2, "n1", PEER), (3, "n2", PEER))
    assert judge(PEER, "n1", 4, past, 3, True).decision is Decision.RESTART


def test_the_stop_is_off_at_zero_and_fires_at_once_at_one() -> None:
    past = history(*((c, "n0", BUG) for c in range(6)))
    assert judge(BUG, "n0", 6, past, 0, False).decision is Decision.RESTART
    assert judge(BUG, "n0", 6, past, -1, False).decision is Decision.RESTART
    assert judge(BUG, "n0", 0, (), 1, False).decision is Decision.STOP


def test_a_late_reader_ignores_failures_of_later_cycles() -> None:
    past = history((0, "n0", BUG), (1, "n0", BUG), (2, "n1", OTHER))
    assert judge(BUG, "n0", 1, past, 2, True).decision is Decision.STOP


# ---- judge: evidence against a node ------------------------------------------------------------


def test_a_fault_that_follows_the_node_across_placements_excludes_it() -> None:
    past = history((1, "n1", OTHER, range(2, 4)), (2, "n0", BUG, range(2, 4)))
    found = judge(OTHER, "n1", 3, past, 3, True, ranks=range(0, 2))
    assert found.decision is Decision.EXCLUDE
    assert "ranks 2-3 in cycle 1 and ranks 0-1 in cycle 3, alone both times" in found.reason
    assert OTHER.key in found.reason


def test_the_same_node_failing_twice_in_the_same_place_is_not_evidence() -> None:
    past = history((1, "n1", OTHER, range(2, 4)))
    found = judge(OTHER, "n1", 2, past, 3, True, ranks=range(2, 4))
    assert found.decision is Decision.RESTART
    assert "failed the same way again" in found.reason and "3 cycles in a row stop" in found.reason


def test_overlapping_or_unknown_placements_are_not_evidence() -> None:
    past = history((1, "n1", OTHER, range(2, 4)))
    assert judge(OTHER, "n1", 2, past, 3, True, ranks=range(3, 5)).decision is Decision.RESTART
    assert judge(OTHER, "n1", 2, past, 3, True).decision is Decision.RESTART
    unknown = history((1, "n1", OTHER))
    found = judge(OTHER, "n1", 2, unknown, 3, True, ranks=range(0, 2))
    assert found.decision is Decision.RESTART


def test_a_failure_shared_with_other_nodes_is_not_the_nodes_fault() -> None:
    then = history((1, "n1", OTHER, range(2, 4)), (1, "n0", OTHER, range(0, 2)))
    assert judge(OTHER, "n1", 3, then, 3, True, ranks=range(0, 2)).decision is Decision.RESTART
    now = history((1, "n1", OTHER, range(2, 4)), (3, "n0", OTHER, range(2, 4)))
    assert judge(OTHER, "n1", 3, now, 3, True, ranks=range(0, 2)).decision is Decision.RESTART


def test_a_node_the_job_cannot_lose_stays_and_says_why() -> None:
    past = history((1, "n1", OTHER, range(2, 4)))
    found = judge(OTHER, "n1", 2, past, 3, can_lose_node=False, ranks=range(0, 2))
    assert found.decision is Decision.RESTART
    assert "the fault follows the node" in found.reason and "stays: no standby" in found.reason


def test_the_stop_wins_over_the_exclusion() -> None:
    past = history((1, "n1", BUG, range(2, 4)))
    assert judge(BUG, "n1", 2, past, 3, True, ranks=range(0, 2)).decision is Decision.EXCLUDE
    assert judge(BUG, "n1", 2, past, 2, True, ranks=range(0, 2)).decision is Decision.STOP


# ---- whole jobs, failure after failure -----------------------------------------------------------


def test_a_one_node_job_failing_the_same_way_stops_at_the_third_cycle() -> None:
    actions = run_cycles({"n0": range(0, 1)}, [["n0"]] * 11, standby=False)
    assert len(actions) == 3 and all(a.vote is not None for a in actions[:2])
    assert actions[-1].shutdown is not None
    assert actions[-1].shutdown.code is ExitCode.REPEATED_FAILURE


def test_a_two_node_job_failing_the_same_way_stops_at_the_third_cycle() -> None:
    # Either node, or both, may record a cycle's failure (the other may see the restart first).
    failing = [["n0", "n1"], ["n1"], ["n0", "n1"], ["n0"]]
    actions = run_cycles({"n0": range(0, 1), "n1": range(1, 2)}, failing, standby=False)
    assert len(actions) == 4 and actions[-1].shutdown is not None
    assert actions[-1].shutdown.code is ExitCode.REPEATED_FAILURE


def test_a_bug_on_one_rank_with_a_standby_stops_the_job_and_excludes_no_node() -> None:
    # Two active nodes and a standby; the bug is on rank 0, which n0 keeps (slots are sticky).
    actions = run_cycles({"n0": range(0, 1), "n1": range(1, 2)}, [["n0"]] * 11, standby=True)
    assert [a.leave for a in actions] == [None, None, None]
    assert actions[1].note is not None and "failed the same way again" in actions[1].note
    assert actions[-1].shutdown is not None
    assert actions[-1].shutdown.code is ExitCode.REPEATED_FAILURE


def test_a_node_whose_fault_moves_with_it_leaves_and_the_job_goes_on() -> None:
    # n1 failed holding ranks 2-3; after a change of membership it holds 0-1 and fails again.
    past = history((0, "n1", OTHER, range(2, 4)))
    action = decide(crash(OTHER), history=past, cycle=1, ranks=range(0, 2))
    assert action.leave is not None and "the fault follows the node" in action.leave
    assert action.vote == RestartVote(action.leave)  # a failure: it spends the budget
    assert action.outcome == Outcome(ExitCode.EXCLUDED, action.leave)


# ---- the history in the store ------------------------------------------------------------------


def test_records_keep_their_ranks_in_the_store_and_old_lines_still_read() -> None:
    store = HashStore()
    control = job_control(store, "job")
    control.record_failure(FailureRecord(0, "n0", BUG.key, range(8, 16)))
    control.record_failure(FailureRecord(1, "n1", OTHER.key))
    store.append("ftrun/job/failure_log", json.dumps([2, "n2", BUG.key]) + "\n")  # no ranks
    assert control.failure_history() == (
        FailureRecord(0, "n0", BUG.key, range(8, 16)),
        FailureRecord(1, "n1", OTHER.key),
        FailureRecord(2, "n2", BUG.key),
    )


def test_a_nodes_ranks_are_its_block_of_the_round() -> None:
    nodes = tuple(NodeDescriptor(n, "h", size, 0) for n, size in (("a", 2), ("b", 4), ("c", 2)))
    rnd = Round(3, nodes, group_rank=1)
    assert [rnd.ranks_of(n) for n in ("a", "b", "c", "x")] == [
        range(0, 2), range(2, 6), range(6, 8), range(0)
    ]  # fmt: skip


# ---- the policy's transitions ----------------------------------------------------------------


def test_a_named_crash_restarts_and_is_recorded() -> None:
    action = decide(crash(BUG))
    cause = f"rank 2 on n1 exited with code 1: {BUG.key}"
    assert action == Action(S.STOPPING, vote=RestartVote(cause), record=BUG)


def test_an_unnamed_crash_restarts_as_before() -> None:
    assert decide(crash(None)) == Action(S.STOPPING, vote=RestartVote("rank 2 on n1 exited with "
                                                                       "code 1"))  # fmt: skip


def test_a_crash_seen_in_n_cycles_in_a_row_shuts_the_job_down_not_relaunched() -> None:
    action = decide(crash(BUG), history=history((3, "n0", BUG), (4, "n2", BUG)), cycle=5)
    assert action.next_state is S.STOPPING and action.record == BUG
    assert action.shutdown is not None
    assert action.shutdown.code is ExitCode.REPEATED_FAILURE


def test_a_node_failing_twice_in_its_place_restarts_with_a_note() -> None:
    past = history((2, "n1", OTHER, range(2, 4)))
    action = decide(crash(OTHER), history=past, cycle=3, ranks=range(2, 4))
    assert action.leave is None and action.vote is not None and action.shutdown is None
    assert action.note is not None and "not told apart" in action.note


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
