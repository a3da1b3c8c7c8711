"""The in-process API surface (`ftrun.inprocess`'s NVRx-named modules), without processes: the
state, composition, restart budget, health checks, rank assignments (ranks simulated as threads
sharing one store), finalize and abort."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ftrun import infiniband
from ftrun.inprocess import abort as abort_mod
from ftrun.inprocess import exception, health_check
from ftrun.inprocess.abort import (
    Abort,
    AbortPersistentCheckpointProcesses,
    AbortTorchDistributed,
    AbortTransformerEngine,
)
from ftrun.inprocess.compose import Compose
from ftrun.inprocess.finalize import ThreadedFinalize
from ftrun.inprocess.health_check import (
    ChainedGPUHealthCheck,
    ChainedNicHealthCheck,
    ChainedNVLHealthCheck,
    CudaHealthCheck,
    FaultCounter,
    FaultCounterExceeded,
    HealthCheck,
    default_health_checks,
)
from ftrun.inprocess.initialize import RetryController
from ftrun.inprocess.nested_restarter import (
    NestedRestarterAborted,
    NestedRestarterHandlingCompleted,
    NestedRestarterHandlingStarting,
)
from ftrun.inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    Layer,
    LayerFlag,
    MaxActiveWorldSize,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    ShiftRanks,
    Tree,
)
from ftrun.inprocess.state import FrozenState, Mode, State

WAIT_S = 10.0


# --- state, exceptions, compose ---------------------------------------------------------------


def test_state_defaults_freeze_advance_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    state = State.from_env()
    assert (state.rank, state.world_size, state.initial_rank, state.initial_world_size) == (
        3, 8, 3, 8,
    )  # fmt: skip
    assert state.mode is Mode.INITIALIZED and state.iteration == 0
    state.fn_exception = ValueError("boom")
    frozen = state.freeze()
    assert isinstance(frozen, FrozenState) and frozen.fn_exception is state.fn_exception
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.rank = 1  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(FrozenState)] == [
        f.name for f in dataclasses.fields(State)
    ]
    state.advance()
    assert state.iteration == 1 and state.fn_exception is None
    other = State(rank=0, world_size=4, active_rank=0, active_world_size=4, iteration=7)
    state.copy_from(other, fields=["active_rank", "iteration"])
    assert (state.rank, state.active_rank, state.iteration) == (3, 0, 7)
    state.active_world_size = 4
    state.set_distributed_vars()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "4")


def test_exception_hierarchy() -> None:
    assert issubclass(exception.HealthCheckError, exception.RestartError)
    assert issubclass(exception.TimeoutError, exception.RestartError)
    assert issubclass(exception.InternalError, exception.RestartError)
    assert not issubclass(exception.RestartAbort, Exception)
    assert issubclass(health_check.HealthCheckTimeoutError, exception.HealthCheckError)
    assert issubclass(health_check.HealthCheckTimeoutError, exception.TimeoutError)


class _AbortA(Abort):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def __call__(self, state: FrozenState) -> FrozenState:
        self.calls.append("a")
        return state


class _AbortB(_AbortA):
    def __call__(self, state: FrozenState) -> FrozenState:
        self.calls.append("b")
        return state


class _AbortC(Abort):
    def __call__(self, state: FrozenState) -> FrozenState:
        return state


def test_compose_order_and_type() -> None:
    assert Compose(lambda x: x + 1, lambda x: x * 2)(3) == 7  # a(b(x))
    calls: list[str] = []
    a, b = _AbortA(calls), _AbortB(calls)
    composed = Compose(a, b, _AbortC())
    assert isinstance(composed, Abort) and not isinstance(composed, _AbortA)
    assert composed.instances[:2] == (a, b)
    state = State(0, 1).freeze()
    assert composed(state) is state
    assert calls == ["b", "a"]
    assert isinstance(Compose(a, b), _AbortA)  # the lowest common base
    assert isinstance(Compose(composed, _AbortC()), Abort)  # a Compose composes as its base


def test_compose_warns_when_a_stage_drops_the_argument() -> None:
    with pytest.warns(UserWarning, match="returned None"):
        assert Compose(lambda x: x, lambda x: None)(1) is None


# --- initialize, health checks ------------------------------------------------------------------


def test_retry_controller() -> None:
    control = RetryController(max_iterations=2, min_world_size=2, min_active_world_size=2)
    control(FrozenState(rank=0, world_size=4, active_world_size=4, iteration=1))
    for state in (
        FrozenState(rank=0, world_size=4, active_world_size=4, iteration=2),
        FrozenState(rank=0, world_size=1, active_world_size=1, iteration=0),
        FrozenState(rank=0, world_size=4, active_world_size=1, iteration=0),
    ):
        with pytest.raises(exception.RestartAbort):
            control(state)
    RetryController()(FrozenState(rank=0, world_size=1, iteration=10**6))


def test_fault_counter() -> None:
    counter = FaultCounter(max_rank_faults=1)
    clean = FrozenState(rank=0, world_size=2)
    failed = FrozenState(rank=0, world_size=2, fn_exception=RuntimeError("x"))
    counter(clean)
    counter(failed)
    counter(clean)
    with pytest.raises(FaultCounterExceeded):
        counter(failed)
    FaultCounter()(failed)


def test_gpu_checks_pass_on_a_cpu_rank_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_nvml() -> None:
        raise AssertionError("a CPU rank must not touch NVML")

    monkeypatch.setattr("ftrun.nvml.nvml_session", no_nvml)
    monkeypatch.setenv("LOCAL_RANK", "1")  # NVRx would check GPU 1 here
    state = FrozenState(rank=1, world_size=2, fn_exception=RuntimeError("x"))
    assert CudaHealthCheck()(state) is state
    user = FaultCounter(max_rank_faults=3)
    chain = default_health_checks(Compose(user, CudaHealthCheck()))
    assert isinstance(chain, HealthCheck)
    assert chain.instances[0] is user and len(chain.instances) == 5
    assert chain(state) is state
    assert user.faults_count == 1
    assert default_health_checks(None)(state) is state


def test_gpu_checks_against_the_fake_nvml(
    fake_nvml: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = {"devices": 2, "faults": {"1": ["retired_pages", "nvlink"]}}
    fake_nvml.setenv("FAKE_NVML", json.dumps(spec))
    state = FrozenState(rank=0, world_size=1)
    ChainedGPUHealthCheck(device_index=0)(state)
    with pytest.raises(exception.HealthCheckError, match="retired pages"):
        ChainedGPUHealthCheck(device_index=1)(state)
    with caplog.at_level(logging.WARNING, logger="ftrun.inprocess"):
        ChainedNVLHealthCheck(device_index=1)(state)  # logged, not fatal (as NVRx)
    assert "NVLink(s) [0, 1] not up" in caplog.text
    ChainedNicHealthCheck(device_index=1)(state)  # the fake has no PCI info: nothing to check
    with pytest.raises(exception.HealthCheckError, match="NVML failed"):
        ChainedGPUHealthCheck(device_index=5)(state)


def _fake_sysfs(tmp_path: Path, port_state: str) -> tuple[str, str]:
    """A PCI tree with a GPU and mlx5_0 under one switch, mlx5_1 under another."""
    tree = tmp_path / "devices" / "pci0000:00"
    gpu = tree / "0000:00:01.0" / "0000:07:00.0"
    nics = {"mlx5_0": tree / "0000:00:01.0" / "0000:08:00.0", "mlx5_1": tree / "0000:00:02.0"}
    pci, ib = tmp_path / "pci", tmp_path / "ib"
    gpu.mkdir(parents=True)
    pci.mkdir()
    (pci / "0000:07:00.0").symlink_to(gpu)
    for name, where in nics.items():
        where.mkdir(parents=True, exist_ok=True)
        (ib / name / "ports" / "1").mkdir(parents=True)
        (ib / name / "device").symlink_to(where)
        state = port_state if name == "mlx5_0" else "1: DOWN"
        (ib / name / "ports" / "1" / "state").write_text(state + "\n")
    return str(ib), str(pci)


def test_nic_check_reads_the_nearest_nic(tmp_path: Path) -> None:
    ib, pci = _fake_sysfs(tmp_path, "4: ACTIVE")
    assert infiniband.nearest_ib_device("0000:07:00.0", ib, pci) == "mlx5_0"
    assert infiniband.ib_ports_down(os.path.join(ib, "mlx5_0")) == []
    assert infiniband.ib_ports_down(os.path.join(ib, "mlx5_1")) == ["1 (DOWN)"]
    assert infiniband.nearest_ib_device("0000:99:00.0", ib, pci) is None
    assert infiniband.nearest_ib_device("0000:07:00.0", str(tmp_path / "none"), pci) is None


# --- rank assignment ----------------------------------------------------------------------------


def _run_ranks(ranks: list[int], fn: Callable[[int], Any]) -> dict[int, Any]:
    """fn(rank) for each rank in its own thread; the result or the exception, by rank."""
    results: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    return results


class _World:
    """Ranks simulated in threads: each with its own State (and assignment instance where
    the assignment keeps state, as Tree does) and one shared store, scoped per iteration."""

    def __init__(self, world_size: int, make: Callable[[], RankAssignment]) -> None:
        self.base = dist.HashStore()
        self.base.set_timeout(datetime.timedelta(seconds=WAIT_S))
        self.states = {r: State(rank=r, world_size=world_size) for r in range(world_size)}
        self.assignments = {r: make() for r in range(world_size)}
        self.iteration = 0

    def step(self, dead: Iterable[int] = ()) -> dict[int, Any]:
        """One assignment round; returns {initial rank: new State or the exception}."""
        terminated = set(dead)
        store = dist.PrefixStore(str(self.iteration), self.base)
        self.iteration += 1
        alive = {i: s for i, s in self.states.items() if s.rank not in terminated}

        def assign(initial: int) -> State:
            ctx = RankAssignmentCtx(alive[initial], store, set(terminated))
            return self.assignments[initial](ctx).state

        results = _run_ranks(sorted(alive), assign)
        self.states = {i: results[i] for i in sorted(results) if isinstance(results[i], State)}
        return results

    def view(self) -> dict[int, tuple[Any, ...]]:
        """{initial rank: (rank, world size, active rank, active world size)}."""
        return {
            i: (s.rank, s.world_size, s.active_rank, s.active_world_size)
            for i, s in self.states.items()
        }


def test_shift_ranks_and_fill_gaps() -> None:
    shift = _World(8, lambda: Compose(ActivateAllRanks(), ShiftRanks()))
    shift.step()
    results = shift.step({1, 4, 5})
    assert {i for i, r in results.items() if isinstance(r, RankDiscarded)} == set()
    assert {i: s.rank for i, s in shift.states.items()} == {0: 0, 2: 1, 3: 2, 6: 3, 7: 4}
    assert all(s.world_size == 5 and s.active_world_size == 5 for s in shift.states.values())
    fill = _World(8, lambda: Compose(ActivateAllRanks(), FillGaps()))
    fill.step({1, 4, 5})
    assert {i: s.rank for i, s in fill.states.items()} == {0: 0, 2: 2, 3: 3, 6: 1, 7: 4}
    fill.step({0})
    assert {i: s.rank for i, s in fill.states.items()} == {2: 2, 3: 3, 6: 1, 7: 0}


def test_a_terminated_rank_is_discarded() -> None:
    for assignment in (ShiftRanks(), FillGaps()):
        ctx = RankAssignmentCtx(State(rank=2, world_size=4), dist.HashStore(), {2})
        with pytest.raises(RankDiscarded):
            assignment(ctx)


def test_activation_filters() -> None:
    world = _World(7, lambda: Compose(MaxActiveWorldSize(5), ActivateAllRanks()))
    world.step()
    assert [s.mode for s in world.states.values()] == [Mode.ACTIVE] * 5 + [Mode.INACTIVE] * 2
    assert world.states[6].active_rank is None and world.states[6].active_world_size == 5
    world = _World(7, lambda: Compose(ActiveWorldSizeDivisibleBy(4), ShiftRanks()))
    world.step({2})
    assert world.view()[6] == (5, 6, None, 4)
    assert world.view()[4] == (3, 6, 3, 4)
    world = _World(3, lambda: Compose(MaxActiveWorldSize(None), ActiveWorldSizeDivisibleBy(2)))
    world.step()
    assert world.view() == {0: (0, 3, 0, 2), 1: (1, 3, 1, 2), 2: (2, 3, None, 2)}


def test_filter_count_grouped_by_key_terminates_broken_groups() -> None:
    def make() -> RankAssignment:
        by_pair = FilterCountGroupedByKey(lambda s: s.rank // 2, lambda count: count == 2)
        return Compose(ActivateAllRanks(), ShiftRanks(), by_pair)

    world = _World(8, make)
    results = world.step({1, 4})
    discarded = {i for i, r in results.items() if isinstance(r, RankDiscarded)}
    assert discarded == {0, 5}
    assert {i: s.rank for i, s in world.states.items()} == {2: 0, 3: 1, 6: 2, 7: 3}


def _node(state: State) -> str:
    return f"node{state.initial_rank // 2}"


def test_tree_reserve_rank_replaces_a_terminated_one() -> None:
    def make() -> Tree:
        return Tree([
            Layer(min_ranks=1, max_ranks=4, key_or_fn="root", flag=LayerFlag.RESERVE),
            Layer(min_ranks=1, max_ranks=2, key_or_fn=_node, flag=LayerFlag.RESERVE),
        ])  # fmt: skip

    world = _World(5, make)  # nodes {0, 1} {2, 3} {4}; the root allows 4 active ranks
    world.step()
    assert world.view() == {
        0: (0, 5, 0, 4), 1: (1, 5, 1, 4), 2: (2, 5, 2, 4), 3: (3, 5, 3, 4), 4: (4, 5, None, 4),
    }  # fmt: skip
    assert world.states[4].mode is Mode.INACTIVE
    results = world.step({1})  # the reserve (initial rank 4) takes active rank 1
    assert 1 not in results  # rank 1 was dead: it did not run
    assert world.view() == {0: (0, 4, 0, 4), 2: (1, 4, 2, 4), 3: (2, 4, 3, 4), 4: (3, 4, 1, 4)}
    assert world.states[4].mode is Mode.ACTIVE
    world.step({3})  # no reserve left and no backfill: the gap closes by shifting
    assert world.view() == {0: (0, 3, 0, 3), 2: (1, 3, 1, 3), 3: (2, 3, 2, 3)}


def test_tree_backfill_and_min_ranks() -> None:
    def make() -> Tree:
        return Tree([
            Layer(key_or_fn="root", flag=LayerFlag.BACKFILL),
            Layer(min_ranks=2, max_ranks=2, key_or_fn=_node, flag=LayerFlag.BACKFILL),
        ])  # fmt: skip

    world = _World(6, make)  # nodes {0, 1} {2, 3} {4, 5}, all active
    world.step()
    results = world.step({0})  # node0 falls below min_ranks: initial rank 1 goes too
    assert isinstance(results[1], RankDiscarded)
    # The two highest active ranks (initial 4 and 5) backfill active ranks 0 and 1, in order.
    assert world.view() == {2: (0, 4, 2, 4), 3: (1, 4, 3, 4), 4: (2, 4, 0, 4), 5: (3, 4, 1, 4)}


def test_tree_world_size_filter() -> None:
    world = _World(5, lambda: Tree([Layer(key_or_fn="root")], lambda n: n // 2 * 2))
    world.step()
    assert [s.active_rank for s in world.states.values()] == [0, 1, 2, 3, None]
    assert all(s.active_world_size == 4 for s in world.states.values())


# --- finalize, abort, nested restarter ----------------------------------------------------------


def test_threaded_finalize() -> None:
    release = threading.Event()
    calls: list[int] = []
    state = FrozenState(rank=0, world_size=1)
    quick = ThreadedFinalize(datetime.timedelta(seconds=WAIT_S), calls.append, args=(1,))
    assert quick(state) is state and calls == [1]
    stuck = ThreadedFinalize(datetime.timedelta(seconds=0.05), release.wait, kwargs={"timeout": 5})
    try:
        with pytest.raises(exception.TimeoutError):
            stuck(state)
    finally:
        release.set()

    def broken() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        ThreadedFinalize(datetime.timedelta(seconds=WAIT_S), broken)(state)


def test_abort_torch_distributed_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.new_group([0])
        abort = Compose(AbortPersistentCheckpointProcesses(), AbortTransformerEngine())
        abort = Compose(AbortTorchDistributed(str(tmp_path), timeout=WAIT_S), abort)
        abort(FrozenState(rank=0, world_size=1, iteration=2))
        assert not dist.is_initialized()
        assert (tmp_path / "iter_2" / "_dump_0.json").is_file()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    AbortTorchDistributed()(FrozenState(rank=0, world_size=1))  # nothing to abort


def test_abort_torch_distributed_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(abort_mod, "_backend_aborts", lambda: {"stuck": release.wait})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(exception.TimeoutError, match="stuck"):
            AbortTorchDistributed(timeout=0.05)(FrozenState(rank=0, world_size=1))
    finally:
        release.set()
        dist.destroy_process_group()


def test_nested_restarter_lines(caplog: pytest.LogCaptureFixture) -> None:
    first = FrozenState(rank=0, world_size=2)
    other = FrozenState(rank=1, world_size=2)
    completed = NestedRestarterHandlingCompleted()
    with caplog.at_level(logging.INFO, logger="ftrun.inprocess"):
        completed(first)
        NestedRestarterHandlingStarting()(first)
        completed(first)
        NestedRestarterAborted()(other)  # not the special rank: silent
    assert [r.getMessage() for r in caplog.records] == [
        "[NestedRestarter] name=[InProcess] state=initialize",
        "[NestedRestarter] name=[InProcess] state=handling stage=starting",
        "[NestedRestarter] name=[InProcess] state=handling stage=completed",
    ]
    assert isinstance(NestedRestarterHandlingStarting(), Abort)


def test_a_restarts_split_is_told_once_per_restart(caplog: pytest.LogCaptureFixture) -> None:
    from ftrun.inprocess.events import AgentReports, PhaseClock

    clock = PhaseClock()
    clock.mark("enter")  # the first call: no restart to tell
    assert clock.take() is None
    clock.record("watcher_abort", 0.5)  # not in a restart: dropped
    clock.start()
    clock.record("watcher_abort", 0.125)  # timed by the watcher thread: the clock stays
    for phase in ("abort", "barrier", "health_check"):
        clock.mark(phase)
    assert clock.elapsed == pytest.approx(sum(clock.phases.values()) - 0.125, abs=1e-3)
    phases = clock.take()
    assert list(phases or {}) == ["watcher_abort", "abort", "barrier", "health_check"]
    assert clock.take() is None
    reports = AgentReports.for_rank(1, {})  # no launcher: log lines only
    with caplog.at_level(logging.INFO, logger="ftrun.inprocess"):
        reports.entered(1, {"abort": 0.5, "barrier": 0.25}, 0.75)
    reports.close()
    assert caplog.messages == [
        "in-process restart: rank 1 entered iteration 1 after 0.750s: abort 0.500s, barrier 0.250s"
    ]


def test_a_call_wrapper_parameter_without_its_annotation_is_one_warning_and_still_gets_it(
) -> None:
    """NVRx passes the CallWrapper by annotation only: an unannotated `call_wrapper` got None,
    and every call failed the same way, restart after restart."""
    from ftrun.inprocess.params import check_call_wrapper_parameters, substitute_call_wrapper

    def train(model, call_wrapper=None):  # as a user writes it
        return call_wrapper

    with pytest.warns(UserWarning, match="parameter 'call_wrapper' is not annotated CallWrapper"):
        check_call_wrapper_parameters(train)
    given = object()
    args, kwargs = substitute_call_wrapper(train, ("m",), {}, given)
    assert train(*args, **kwargs) is given
