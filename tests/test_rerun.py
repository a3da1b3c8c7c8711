"""The re-run state machine in one process (no process group: a flag's all-reduce is the flag),
and the launcher's side of it without processes: the policy's exits 16 and 17, the slots of a
round a node steps aside from, and the facts a rank writes for its launcher."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import HashStore

from ftrun.agent.decisions import policy as p
from ftrun.agent.decisions.policy import Facts, Policy, RestartVote
from ftrun.agent.decisions.state import AgentState
from ftrun.agent.loop.facts import _rerun_facts as rerun_facts
from ftrun.config.rendezvous import RendezvousImpl
from ftrun.errors import ExitCode
from ftrun.rendezvous.control import Shutdown, job_control
from ftrun.rendezvous.slots import Arrival, RoundView, plan_round
from ftrun.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunDataIterator,
    RerunDiagnostic,
    RerunMode,
    RerunState,
    RerunStateMachine,
)
from ftrun.rerun.verdicts import collect

SPIKE = "loss spike"


def too_big(value: torch.Tensor) -> bool:
    return float(value) > 100.0


def step(rsm: RerunStateMachine, data: RerunDataIterator, flip: callable) -> tuple[int, list]:
    """One training step as a loop writes it; (runs of the forward-backward, losses seen)."""
    runs, seen = 0, []
    while rsm.should_run_forward_backward(data):
        runs += 1
        loss = next(data).sum() * (1000.0 if flip(rsm) else 1.0)
        seen.append(float(loss))
        rsm.validate_result(loss, too_big, SPIKE, fatal=True)
    return runs, seen


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("FTRUN_NODE", "n1")
    monkeypatch.setenv("FTRUN_IPC_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    return tmp_path


def machine(first: int = 1) -> tuple[RerunStateMachine, RerunDataIterator]:
    """A machine, and a loader whose batch i is [i, i] from batch `first` on (a loader resumed
    after the step to re-run starts after it: the machine replays that step's batches)."""
    batches = (torch.full((2,), float(i)) for i in range(first, 1000))
    return RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS), RerunDataIterator(batches)


def warm(rsm: RerunStateMachine, data: RerunDataIterator) -> None:
    """The first step is never validated (nothing to resume from before it)."""
    assert step(rsm, data, lambda _: True) == (1, [2000.0])
    assert rsm.should_checkpoint_and_exit() == (False, False, 0)


def test_a_clean_step_runs_once(node: Path) -> None:
    rsm, data = machine()
    warm(rsm, data)
    assert step(rsm, data, lambda _: False) == (1, [4.0])
    assert rsm.should_checkpoint_and_exit() == (False, False, 0)
    assert collect(node) == []


def test_a_one_off_flip_is_transient_and_the_step_goes_on(node: Path) -> None:
    rsm, data = machine()
    warm(rsm, data)
    runs, seen = step(rsm, data, lambda m: m.state is RerunState.INITIAL_RUN)
    assert (runs, seen) == (2, [4000.0, 4.0])  # the re-run saw the same batch
    assert rsm.should_checkpoint_and_exit() == (False, False, 0)
    assert rsm.diagnostics[-1][1] is RerunDiagnostic.TRANSIENT_ERROR
    [fact] = collect(node)
    assert (fact.kind, fact.diagnostic, fact.rank, fact.node) == (
        "verdict", "transient_error", 3, "n1",
    )  # fmt: skip


def test_a_reproduced_flip_checkpoints_exits_16_and_is_judged_elsewhere(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rsm, data = machine()
    warm(rsm, data)
    assert step(rsm, data, lambda _: True) == (2, [4000.0, 4000.0])
    assert rsm.should_checkpoint_and_exit() == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    [suspect] = collect(node)
    assert (suspect.kind, suspect.node) == ("suspect", "n1")
    saved = rsm.state_dict(data)
    assert saved["state"] == "WILL_RERUN_FROM_CHECKPOINT"
    assert torch.equal(saved["data_iterators"][0]["saved_microbatches"][0], torch.full((2,), 2.0))

    monkeypatch.setenv("FTRUN_NODE", "n9")  # another node: the hardware was n1's
    again, data2 = machine(first=3)
    again.load_state_dict(saved)
    assert step(again, data2, lambda _: False) == (1, [4.0])
    assert again.should_checkpoint_and_exit() == (False, False, 0)
    [verdict] = collect(node)
    assert (verdict.diagnostic, verdict.suspect_node, verdict.node) == (
        "persistent_error", "n1", "n9",
    )  # fmt: skip
    assert step(again, data2, lambda _: False) == (1, [6.0])  # and training goes on


def test_reproduced_elsewhere_is_correct_and_fatal_exits_17(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rsm, data = machine()
    warm(rsm, data)
    step(rsm, data, lambda _: True)
    saved = rsm.state_dict(data)
    monkeypatch.setenv("FTRUN_NODE", "n9")
    again, data2 = machine()
    again.load_state_dict(saved)
    step(again, data2, lambda _: True)
    assert again.should_checkpoint_and_exit() == (
        False,
        True,
        EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    )
    assert [f.diagnostic for f in collect(node)] == ["", "correct_result"]


def test_rescheduled_on_the_suspect_gpu_asks_to_resume_again(node: Path) -> None:
    rsm, data = machine()
    warm(rsm, data)
    step(rsm, data, lambda _: True)
    again, data2 = machine()
    again.load_state_dict(rsm.state_dict(data))  # FTRUN_NODE unchanged: the same GPU
    step(again, data2, lambda _: True)
    assert again.state is RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
    assert again.should_checkpoint_and_exit() == (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    with pytest.raises(RuntimeError, match="re-run on another GPU"):
        again.should_run_forward_backward(data2)


def test_disabled_validates_and_raises_only_when_fatal(node: Path) -> None:
    rsm = RerunStateMachine()
    rsm.validate_result(torch.tensor(1.0), too_big, SPIKE)
    with pytest.raises(RuntimeError, match=r"unexpected result 500\.0"):
        rsm.validate_result(torch.tensor(500.0), too_big, SPIKE)
    rsm.validate_result(torch.tensor(500.0), too_big, SPIKE, fatal=False)


def test_determinism_stats_rerun_every_nth_step() -> None:
    rsm = RerunStateMachine(mode=RerunMode.REPORT_DETERMINISM_STATS, determinism_every=2)
    data = RerunDataIterator(torch.ones(1) * i for i in range(100))
    runs = [step(rsm, data, lambda _: False)[0] for _ in range(6)]
    assert runs == [2, 1, 2, 1, 2, 1]
    assert rsm.stats.summary()[SPIKE]["count"] == 3.0
    assert rsm.stats.summary()[SPIKE]["max"] == 0.0


def test_validate_outside_the_loop_and_illegal_moves_are_errors() -> None:
    rsm, _ = machine()
    with pytest.raises(RuntimeError, match="outside"):
        rsm.validate_result(torch.tensor(1.0), too_big, SPIKE)
    with pytest.raises(RuntimeError, match="not allowed"):
        rsm._move(RerunState.RERUNNING_FROM_CHECKPOINT)


def test_a_data_iterator_replays_its_step_and_its_state() -> None:
    data = RerunDataIterator(iter(range(10)))
    data.advance()
    assert [next(data), next(data)] == [0, 1]
    data.rewind()
    assert [next(data), next(data), next(data)] == [0, 1, 2]
    fresh = RerunDataIterator(iter(range(100, 110)))
    fresh.load_state_dict(data.state_dict())
    assert [next(fresh), next(fresh), next(fresh), next(fresh)] == [0, 1, 2, 100]


def test_facts_a_launcher_cannot_read_are_dropped(tmp_path: Path) -> None:
    folder = tmp_path / "rerun"
    folder.mkdir()
    (folder / "verdict-x.json").write_text('{"kind": "verdict"}')
    (folder / "torn.json").write_text("{")
    typed = '{"kind": "verdict", "rank": "3", "node": "n", "iteration": 1, "message": "m"}'
    (folder / "verdict-y.json").write_text(typed)
    assert collect(tmp_path) == [] and list(folder.iterdir()) == []


# ---- the launcher: the policy's exits 16 and 17 ------------------------------------------------

FACTS = Facts(node="n1", cycle=3, round_size=2, max_nodes=2)


def ended(code: int, **facts: object) -> p.Action:
    event = p.WorkerEnded(rank=3, returncode=code, others_running=1)
    return Policy(2).decide(AgentState.RUNNING, event, dataclasses.replace(FACTS, **facts))


def test_exit_16_with_a_standby_restarts_without_spending_the_budget() -> None:
    action = ended(16, standby_waiting=1)
    assert action.next_state is AgentState.STOPPING and action.shutdown is None and action.drain
    assert action.vote == RestartVote("rank 3 on n1: a rejected result is re-run on another "
                                      "node", failure=False, rerun=True)  # fmt: skip


def test_exit_16_without_a_standby_ends_the_job_with_16_for_a_relaunch() -> None:
    action = ended(16)
    assert action.shutdown is not None and action.shutdown.code is ExitCode.RESUME_TO_DISAMBIGUATE
    assert action.drain


def test_a_re_runs_end_lets_the_other_ranks_finish_saving_instead_of_killing_them() -> None:
    """Every rank exits 16 once its checkpoint part is saved, not all at once: the first exit,
    here or on another node, must not kill the others mid-save (the re-run elsewhere would
    restore nothing and start over)."""
    assert all(ended(code, standby_waiting=1).drain for code in (16, 17))
    cycle_ended = p.CycleEnded()
    decide = Policy(2).decide
    rerun_restart = dataclasses.replace(FACTS, ended_for_rerun=True)
    assert decide(AgentState.RUNNING, cycle_ended, rerun_restart).drain
    for code in (ExitCode.RESUME_TO_DISAMBIGUATE, ExitCode.FAILED_ON_RESULT_VALIDATION):
        shut = dataclasses.replace(FACTS, shutdown=Shutdown(code, "re-run"))
        assert decide(AgentState.RUNNING, cycle_ended, shut).drain
    for facts in (FACTS, dataclasses.replace(FACTS, shutdown=Shutdown(ExitCode.FAILED, "x"))):
        assert not decide(AgentState.RUNNING, cycle_ended, facts).drain  # a failure: no wait
    assert not ended(1).drain


def test_a_suspect_standing_by_is_no_standby_for_its_own_re_run() -> None:
    """The node that stepped aside for this cycle's re-run (no verdict yet) must not take the
    suspect slot back: with no other standby, the job exits 16 for a relaunch elsewhere."""
    action = ended(16, standby_waiting=1, suspects_standing_by=1)
    assert action.vote is None and action.shutdown is not None
    assert action.shutdown.code is ExitCode.RESUME_TO_DISAMBIGUATE
    assert "suspects of the re-run" in action.shutdown.reason
    other = ended(16, standby_waiting=2, suspects_standing_by=1)
    assert other.shutdown is None and other.vote is not None and other.vote.rerun


def test_a_re_run_asked_for_again_without_a_verdict_exits_16_instead_of_restarting() -> None:
    """Restarts for a re-run are not failures: without a bound they could loop forever."""
    assert p.RERUN_RESTARTS_IN_A_ROW == 1
    action = ended(16, standby_waiting=1, rerun_restarts=1)
    assert action.vote is None and action.shutdown is not None
    assert action.shutdown.code is ExitCode.RESUME_TO_DISAMBIGUATE
    assert "2 cycles in a row" in action.shutdown.reason


def test_exit_17_stops_the_job_with_17() -> None:
    action = ended(17, standby_waiting=1, rerun_restarts=1)
    assert action.shutdown is not None
    assert action.shutdown.code is ExitCode.FAILED_ON_RESULT_VALIDATION


# ---- the round: a node stepping aside -----------------------------------------------------------


def test_a_node_stepping_aside_gives_its_slot_to_a_standby_and_stands_by() -> None:
    arrivals = (Arrival(0, "b"), Arrival(1, "a"), Arrival(2, "c"))
    view = RoundView(2, 2, arrivals, owners=("a", "b"), aside=frozenset({"b"}))
    assert [a.node for a in plan_round(view) or ()] == ["a", "c"]


def test_without_a_standby_the_node_keeps_its_slot() -> None:
    view = RoundView(2, 2, (Arrival(0, "b"), Arrival(1, "a")), owners=("a", "b"),
                     aside=frozenset({"b"}))  # fmt: skip
    assert [a.node for a in plan_round(view) or ()] == ["a", "b"]


def test_the_round_waits_for_the_node_stepping_aside_before_a_standby_takes_its_slot() -> None:
    """It arrives once its stop is over, the re-run's checkpoint replicated: closing before
    would restore nothing for the re-run (it then starts over and reproduces the result on the
    standby, which becomes a suspect too)."""
    early = (Arrival(0, "a"), Arrival(1, "c"))
    view = RoundView(2, 2, early, owners=("a", "b"), aside=frozenset({"b"}))
    assert plan_round(view) is None
    arrived = dataclasses.replace(view, arrivals=(*early, Arrival(2, "b")))
    assert [a.node for a in plan_round(arrived) or ()] == ["a", "c"]
    for late in (dataclasses.replace(view, last_call_over=True),
                 dataclasses.replace(view, gone=frozenset({"b"}))):  # fmt: skip
        assert [a.node for a in plan_round(late) or ()] == ["a", "c"]


def test_the_store_counts_re_run_restarts_in_a_row_back_to_a_verdict() -> None:
    control = job_control(HashStore(), "job")
    assert control.rerun_restarts(0, 5) == 0
    assert control.request_restart(0, "exit 16", failure=False, rerun=True)
    assert not control.request_restart(0, "exit 16 too", failure=False)  # a loser: no mark
    assert control.failures() == 0 and control.rerun_restarts(1, 5) == 1
    assert control.restarted_for_rerun(0) and not control.restarted_for_rerun(1)
    assert control.request_restart(1, "again", failure=False, rerun=True)
    assert control.rerun_restarts(2, 5) == 2 and control.rerun_restarts(2, 1) == 1
    control.settle_rerun(1)  # the re-run of cycle 1 reached a verdict, then another request
    assert control.rerun_restarts(2, 5) == 1
    control.settle_rerun(2)
    assert control.rerun_restarts(2, 5) == 0 and control.rerun_settled(2)
    assert control.request_restart(2, "a crash")  # a failure restart breaks the run
    assert control.rerun_restarts(3, 5) == 0


def test_the_facts_of_an_exit_16_name_the_suspects_standing_by_until_a_verdict() -> None:
    control = job_control(HashStore(), "job")
    rendezvous = SimpleNamespace(num_nodes_waiting=lambda cycle: 2)
    rt = SimpleNamespace(control=control, rendezvous=rendezvous, config=SimpleNamespace(
        rendezvous=SimpleNamespace(impl=RendezvousImpl.BARRIER)))  # fmt: skip
    rnd = SimpleNamespace(number=1, standby=("b", "c"))
    control.request_restart(0, "exit 16", failure=False, rerun=True)
    control.step_aside("b", 1)
    found = rerun_facts(rt, rnd, FACTS)
    assert (found.standby_waiting, found.suspects_standing_by, found.rerun_restarts) == (2, 1, 1)
    control.settle_rerun(1)
    found = rerun_facts(rt, rnd, FACTS)
    assert (found.standby_waiting, found.suspects_standing_by, found.rerun_restarts) == (2, 0, 0)
    rt.config.rendezvous.impl = RendezvousImpl.DYNAMIC  # no stepping aside: no standby to use
    assert rerun_facts(rt, rnd, FACTS) == FACTS
