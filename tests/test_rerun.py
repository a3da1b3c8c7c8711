"""The re-run state machine in one process (no process group: a flag's all-reduce is the flag),
and the launcher's side of it without processes: the policy's exits 16 and 17, the slots of a
round a node steps aside from, and the facts a rank writes for its launcher."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ftrun.agent import policy as p
from ftrun.agent.policy import Facts, Policy, RestartVote
from ftrun.agent.state import AgentState
from ftrun.errors import ExitCode
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
    action = ended(16, standby_waiting=True)
    assert action.next_state is AgentState.STOPPING and action.shutdown is None
    assert action.vote == RestartVote("rank 3 on n1: a rejected result is re-run on another "
                                      "node", failure=False)  # fmt: skip


def test_exit_16_without_a_standby_ends_the_job_with_16_for_a_relaunch() -> None:
    action = ended(16)
    assert action.shutdown is not None and action.shutdown.code is ExitCode.RESUME_TO_DISAMBIGUATE


def test_exit_17_stops_the_job_with_17() -> None:
    action = ended(17, standby_waiting=True)
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
