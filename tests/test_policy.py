"""The agent's decisions, without processes or a store: every transition and every exit code."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from ftrun.agent.decisions import policy as p
from ftrun.agent.decisions.attribution import Kind, Signature, nvrx_stop
from ftrun.agent.decisions.policy import Action, Facts, Outcome, Policy, RestartVote
from ftrun.agent.decisions.state import TRANSITIONS, AgentState
from ftrun.errors import ExitCode, exit_status
from ftrun.rank_monitor.workload import WorkloadAction
from ftrun.rendezvous.control import Shutdown

S = AgentState
POLICY = Policy(max_restarts=2)
FACTS = Facts(node="n0", cycle=4, round_size=2, max_nodes=2)
PREEMPT = Outcome(ExitCode.PREEMPTED, "SIGTERM on node n0")


def decide(state: AgentState, event: p.AgentEvent, **facts: object) -> Action:
    action = POLICY.decide(state, event, dataclasses.replace(FACTS, **facts))
    if action.next_state is not None:  # every decision is a legal move of the state table
        assert action.next_state in TRANSITIONS[state], (state, action)
    return action


# ---- health check and rendezvous ---------------------------------------------------------------


def test_healthy_node_joins() -> None:
    assert decide(S.HEALTH_CHECK, p.HealthChecked()) == Action(S.RENDEZVOUS)


def test_unhealthy_node_tells_the_others_and_exits_do_not_relaunch() -> None:
    action = decide(S.HEALTH_CHECK, p.HealthChecked("GPU 0: 3 uncorrected ECC errors"))
    assert action == Action(
        S.EXITING,
        report_unhealthy="GPU 0: 3 uncorrected ECC errors",
        outcome=Outcome(
            ExitCode.DO_NOT_RELAUNCH, "node unhealthy: GPU 0: 3 uncorrected ECC errors"
        ),
    )


def test_join_goes_ahead_within_budget() -> None:
    assert decide(S.RENDEZVOUS, p.JoinReady(), failures=2) == p.KEEP_WATCHING


def test_spent_budget_shuts_the_job_down_with_failed() -> None:
    action = decide(S.RENDEZVOUS, p.JoinReady(), failures=3)
    assert action.next_state is S.EXITING
    assert action.shutdown is not None and action.shutdown.code is ExitCode.FAILED
    assert "restart budget spent (3 failures, --max-restarts=2)" in action.shutdown.reason


def test_a_shutdown_in_force_ends_the_node_with_its_code() -> None:
    shutdown = Shutdown(ExitCode.PREEMPTED, "SIGTERM on node n1")
    action = decide(S.RENDEZVOUS, p.JoinReady(), shutdown=shutdown, failures=9)
    assert action == Action(S.EXITING, outcome=Outcome(ExitCode.PREEMPTED, "SIGTERM on node n1"))


def test_joined_round_starts_workers() -> None:
    assert decide(S.RENDEZVOUS, p.Joined()) == Action(S.STARTING)


@pytest.mark.parametrize(
    ("event", "shutdown", "expected"),
    [
        (
            p.JoinFailed("rendezvous failed: timeout"),
            None,
            Outcome(ExitCode.FAILED, "rendezvous failed: timeout"),
        ),
        (
            p.JoinFailed("bad infra rank", ExitCode.USAGE),
            None,
            Outcome(ExitCode.USAGE, "bad infra rank"),
        ),
        (p.JoinFailed("closed", closed=True), None, Outcome(ExitCode.FAILED, "closed")),
        (
            p.JoinFailed("closed", closed=True),
            Shutdown(ExitCode.SUCCESS, "rendezvous closed"),
            Outcome(ExitCode.SUCCESS, "rendezvous closed"),
        ),
    ],
)
def test_failed_join_exit_codes(
    event: p.JoinFailed, shutdown: Shutdown | None, expected: Outcome
) -> None:
    assert decide(S.RENDEZVOUS, event, shutdown=shutdown) == Action(S.EXITING, outcome=expected)


# ---- starting and running ----------------------------------------------------------------------


def test_started_workers_are_watched() -> None:
    assert decide(S.STARTING, p.WorkersStarted()) == Action(S.RUNNING)


def test_spawn_failure_votes_for_a_restart() -> None:
    action = decide(S.STARTING, p.SpawnFailed("no such file"))
    assert action == Action(S.STOPPING, vote=RestartVote("spawn failed on n0: no such file"))


@pytest.mark.parametrize(
    ("code", "text"),
    [(3, "exited with code 3"), (-9, "was killed by SIGKILL"), (-11, "was killed by SIGSEGV")],
)
def test_failed_worker_votes_for_a_restart(code: int, text: str) -> None:
    action = decide(S.RUNNING, p.WorkerEnded(rank=5, returncode=code, others_running=1))
    assert action == Action(S.STOPPING, vote=RestartVote(f"rank 5 on n0 {text}"))
    assert action.outcome is None  # restart, not exit


def test_successful_worker_waits_for_the_others_then_succeeds() -> None:
    assert decide(S.RUNNING, p.WorkerEnded(0, 0, others_running=1)) == p.KEEP_WATCHING
    assert decide(S.RUNNING, p.WorkerEnded(1, 0, others_running=0)) == Action(S.SUCCEEDED)


def test_hung_ranks_are_killed_at_once_and_the_cycle_restarts() -> None:
    action = decide(S.RUNNING, p.HangsFound(ranks=(2, 3), pids=(101, 102), kind="heartbeat"))
    assert action == Action(
        S.STOPPING, kill=(101, 102), vote=RestartVote("rank(s) 2, 3 on n0 hung (heartbeat)")
    )


def test_cycle_ended_elsewhere_restarts_here() -> None:
    assert decide(S.RUNNING, p.CycleEnded()) == Action(S.STOPPING)


def test_a_neighbour_gone_while_training_restarts_the_cycle_as_a_failure() -> None:
    action = decide(S.RUNNING, p.NeighbourGone("n1"))
    cause = "node n1 stopped answering while n0's workers ran (lost with its workers)"
    assert action == Action(S.STOPPING, vote=RestartVote(cause))


def test_a_neighbour_gone_after_a_node_finished_changes_nothing() -> None:
    action = decide(S.RUNNING, p.NeighbourGone("n1"), finished_nodes=1)
    assert action.next_state is None and action.vote is None
    assert action.note and "finishing" in action.note


def test_cycle_ended_by_a_shutdown_stops_then_exits_with_its_code() -> None:
    shutdown = Shutdown(ExitCode.FAILED, "restart budget spent")
    action = decide(S.RUNNING, p.CycleEnded(), shutdown=shutdown)
    assert action == Action(S.STOPPING, outcome=Outcome(ExitCode.FAILED, "restart budget spent"))


def test_waiting_nodes_trigger_a_scale_up_vote_that_is_not_a_failure() -> None:
    action = decide(S.RUNNING, p.NodesWaiting(1), round_size=1, max_nodes=2)
    assert action == Action(None, vote=RestartVote("a new node is waiting", failure=False))
    assert decide(S.RUNNING, p.NodesWaiting(0), round_size=1, max_nodes=2) == p.KEEP_WATCHING
    assert decide(S.RUNNING, p.NodesWaiting(3), round_size=2, max_nodes=2) == p.KEEP_WATCHING


# ---- stopping and after success ----------------------------------------------------------------


def test_stopped_workers_restart_or_exit_as_planned() -> None:
    assert decide(S.STOPPING, p.WorkersStopped()) == Action(S.HEALTH_CHECK)
    planned = Outcome(ExitCode.FAILED, "rendezvous store lost")
    assert decide(S.STOPPING, p.WorkersStopped(), after_stop=planned) == Action(
        S.EXITING, outcome=planned
    )


def test_all_peers_finished_is_success_and_ends_the_job_for_standby_nodes() -> None:
    done = Outcome(ExitCode.SUCCESS, "all workers finished")
    assert decide(S.SUCCEEDED, p.PeersFinished()) == Action(S.EXITING, shutdown=done)
    # The exit barrier timed out: this node is done, but it cannot end the job for the others.
    assert decide(S.SUCCEEDED, p.PeersFinished(all_finished=False)) == Action(
        S.EXITING, outcome=done
    )


def test_exclude_this_node_leaves_for_good_and_restarts_the_others_without_a_failure() -> None:
    event = p.ControlRequested(3, WorkloadAction.ExcludeThisNode, "bad GPU")
    why = "rank 3 on n0 asked to exclude its node: bad GPU"
    assert decide(S.RUNNING, event) == Action(
        S.STOPPING,
        leave=why,
        vote=RestartVote(why, failure=False),
        outcome=Outcome(ExitCode.EXCLUDED, why),
    )


def test_shutdown_workload_ends_the_job_do_not_relaunch() -> None:
    event = p.ControlRequested(0, WorkloadAction.ShutdownWorkload, "diverged")
    why = "rank 0 on n0 asked to shut the workload down: diverged"
    assert decide(S.RUNNING, event) == Action(
        S.STOPPING, shutdown=Outcome(ExitCode.DO_NOT_RELAUNCH, why)
    )


def test_continue_changes_nothing() -> None:
    event = p.ControlRequested(0, WorkloadAction.Continue, "fine")
    assert decide(S.RUNNING, event) == Action(None)


@pytest.mark.parametrize(
    ("limit", "stalled", "stops"), [(3, 2, False), (3, 3, True), (0, 9, False)]
)
def test_a_round_after_too_many_cycles_without_progress_ends_the_job(limit, stalled, stops):
    action = Policy(max_restarts=9, max_no_progress_cycles=limit).decide(
        S.RENDEZVOUS, p.Joined(), dataclasses.replace(FACTS, stalled_cycles=stalled)
    )
    if not stops:
        assert action == Action(S.STARTING)
        return
    assert action.next_state is S.EXITING and action.shutdown is not None
    assert action.shutdown.code is ExitCode.NO_PROGRESS
    assert "3 cycles in a row made no progress" in action.shutdown.reason


def test_a_peer_failing_after_this_node_finished_restarts_it() -> None:
    assert decide(S.SUCCEEDED, p.CycleEnded()) == Action(S.HEALTH_CHECK)
    shutdown = Shutdown(ExitCode.PREEMPTED, "SIGTERM on node n1")
    assert decide(S.SUCCEEDED, p.CycleEnded(), shutdown=shutdown) == Action(
        S.EXITING, outcome=Outcome(ExitCode.PREEMPTED, "SIGTERM on node n1")
    )


# ---- signals and a lost store, in every state --------------------------------------------------


@pytest.mark.parametrize("state", [S.RUNNING, S.STARTING])
def test_signal_with_workers_forwards_it_and_preempts_the_job(state: AgentState) -> None:
    action = decide(state, p.Signalled(signal.SIGTERM))
    assert action == Action(S.STOPPING, shutdown=PREEMPT, stop_signal=signal.SIGTERM)


@pytest.mark.parametrize("state", [S.HEALTH_CHECK, S.RENDEZVOUS, S.SUCCEEDED])
def test_signal_without_workers_preempts_at_once(state: AgentState) -> None:
    """Also after this node's workers succeeded: the job is not over, and 75 asks to requeue."""
    action = decide(state, p.Signalled(signal.SIGINT))
    assert action == Action(S.EXITING, shutdown=Outcome(ExitCode.PREEMPTED, "SIGINT on node n0"))


def test_signal_while_stopping_ends_the_node_after_the_stop() -> None:
    assert decide(S.STOPPING, p.Signalled(signal.SIGTERM)) == Action(None, shutdown=PREEMPT)


@pytest.mark.parametrize(
    ("state", "next_state"),
    [
        (S.RUNNING, S.STOPPING),
        (S.STARTING, S.STOPPING),
        (S.STOPPING, None),
        (S.HEALTH_CHECK, S.EXITING),
        (S.RENDEZVOUS, S.EXITING),
        (S.SUCCEEDED, S.EXITING),
    ],
)
def test_lost_store_ends_the_node_with_failed(state: AgentState, next_state: AgentState) -> None:
    action = decide(state, p.StoreLost("connection reset"))
    assert action == Action(next_state, outcome=Outcome(ExitCode.FAILED, "rendezvous store lost"))


def test_an_event_a_state_does_not_expect_is_a_bug() -> None:
    with pytest.raises(ValueError, match="no decision for WorkerEnded in state rendezvous"):
        POLICY.decide(S.RENDEZVOUS, p.WorkerEnded(0, 1, 0), FACTS)


def test_every_state_but_the_last_two_has_decisions() -> None:
    """The table covers each state the executor steps through."""
    decided = {state for state, _ in p._HANDLERS}
    assert decided == set(AgentState) - {S.EXITING, S.EXITED}


# ---- NVRx's --ft-attribution-stop-action and --ft-no-restart-exit-code ---------------------------

BUG = Signature(Kind.EXCEPTION, "ValueError", where="train.py:9 in step", rank=1)


@pytest.mark.parametrize(
    ("signature", "stops"),
    [
        (BUG, True),
        (Signature(Kind.CUDA, "CUDA error: an illegal memory access was encountered"), True),
        (Signature(Kind.SIGNAL, "SIGSEGV"), True),
        (Signature(Kind.SIGNAL, "SIGKILL"), True),
        (Signature(Kind.EXIT, "Segmentation fault", where="train.py:3 in f"), True),
        (Signature(Kind.SIGNAL, "SIGTERM"), False),  # NVRx: RESTART IMMEDIATE
        (Signature(Kind.EXCEPTION, "KeyboardInterrupt"), False),  # SIGINT
        (Signature(Kind.HANG, "heartbeat"), False),  # a GPU sleep, a held GIL: restart
        (Signature(Kind.NCCL, "NCCL error: unhandled system error"), False),
        (Signature(Kind.EXIT, "exit code 3"), False),  # no error in the log: not a STOP
        (Signature(Kind.PEER_LOST, "RuntimeError", secondary=True), False),
        (Signature(Kind.HEALTH, "Xid 79"), False),  # --ft-health-action's
    ],
)
def test_the_failures_nvrx_s_attribution_stops_on(signature: Signature, stops: bool) -> None:
    assert bool(nvrx_stop(signature)) is stops


def test_attribution_stop_no_restart_stops_the_job_at_the_first_such_failure() -> None:
    stopping = Policy(max_restarts=9, attribution_stop="no-restart")
    ended = p.WorkerEnded(rank=1, returncode=1, others_running=1, signature=BUG)
    action = stopping.decide(S.RUNNING, ended, FACTS)  # no history: the first time
    assert action.next_state is S.STOPPING and action.record == BUG and action.vote is None
    assert action.shutdown is not None and action.shutdown.code is ExitCode.REPEATED_FAILURE
    assert "ValueError" in action.shutdown.reason
    assert "--ft-attribution-stop-action=no-restart" in action.shutdown.reason
    # A failure NVRx restarts on restarts as before.
    hang = p.HangsFound(ranks=(2,), pids=(7,), kind="heartbeat",
                        signature=Signature(Kind.HANG, "heartbeat"))  # fmt: skip
    assert stopping.decide(S.RUNNING, hang, FACTS).vote is not None


def test_attribution_stop_log_only_logs_and_restarts() -> None:
    ended = p.WorkerEnded(rank=1, returncode=1, others_running=1, signature=BUG)
    assert POLICY.decide(S.RUNNING, ended, FACTS).note is None  # not set: not mentioned
    action = Policy(max_restarts=9, attribution_stop="log").decide(S.RUNNING, ended, FACTS)
    assert action.shutdown is None and action.vote is not None
    assert "only logged: --ft-attribution-stop-action=log" in (action.note or "")


@pytest.mark.parametrize(
    ("code", "given", "status"),
    [
        (ExitCode.NO_PROGRESS, 93, 93),
        (ExitCode.REPEATED_FAILURE, 93, 93),
        (ExitCode.NO_PROGRESS, None, 4),
        (ExitCode.FAILED, 93, 1),  # a spent budget is not a no-restart decision (NVRx: 1)
        (ExitCode.DO_NOT_RELAUNCH, 93, 3),
        (ExitCode.PREEMPTED, 93, 75),
    ],
)
def test_no_restart_exit_code_replaces_nvrx_s_two_no_restart_causes(
    code: ExitCode, given: int | None, status: int
) -> None:
    assert exit_status(code, given) == status
