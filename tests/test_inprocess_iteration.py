"""The restart iteration's protocol on a store (`ftrun.inprocess_protocol`), without processes:
how an iteration ends (every rank completed, or somebody interrupted it), the barrier, and the
ranks that left; and the options `Wrapper` checks as NVRx does."""

from __future__ import annotations

import datetime
import sys
import threading
import warnings

import pytest
import torch.distributed as dist
from torch.distributed import HashStore

from ftrun.inprocess.abort import pin_gloo_groups
from ftrun.inprocess.assignment_base import RankAssignmentCtx, gather_keys
from ftrun.inprocess.options import build_options
from ftrun.inprocess.params import substitute_call_wrapper
from ftrun.inprocess.state import State
from ftrun.inprocess.watcher import Watcher
from ftrun.inprocess_protocol import (
    CURRENT_KEY,
    Interruption,
    Iteration,
    forget_iteration,
    newest_iteration,
)
from support import wait_for

SHORT = datetime.timedelta(milliseconds=50)


def test_the_last_rank_to_complete_ends_the_iteration_without_an_interruption():
    store = HashStore()
    ranks = [Iteration(store, 0, world_size=3) for _ in range(3)]
    ranks[0].complete()
    ranks[1].complete()
    assert not ranks[0].wait_end(SHORT)
    ranks[2].complete()
    assert ranks[0].wait_end(SHORT) and not ranks[0].was_interrupted()


def test_an_interruption_ends_it_at_once_with_its_reason_first():
    store = HashStore()
    it = Iteration(store, 4, world_size=2)
    it.interrupt(Interruption(1, "EXCEPTION", "RuntimeError: x", at=10.0))
    it.interrupt(Interruption(None, "UNRESPONSIVE", "rank 1 hung", at=11.0))
    assert it.wait_end(SHORT) and it.was_interrupted()
    kinds = [(i.rank, i.kind) for i in it.interruptions()]
    assert kinds == [(1, "EXCEPTION"), (None, "UNRESPONSIVE")]
    assert not Iteration(store, 5, 2).wait_end(SHORT)  # the next iteration is untouched


def test_the_barrier_opens_once_every_rank_arrived_leavers_included():
    store = HashStore()
    it = Iteration(store, 0, world_size=3)
    it.arrive(0)
    it.arrive(2, leaving=True)
    assert not it.wait_go(SHORT)
    it.arrive(1)
    assert it.wait_go(SHORT) and it.terminated(range(3)) == {2}


def test_a_replacement_joins_the_newest_iteration_a_rank_entered():
    store = HashStore()
    assert newest_iteration(store) == 0
    Iteration(store, 3, 2).enter()
    assert newest_iteration(store) == 3 and store.get(CURRENT_KEY) == b"3"


def test_an_iterations_keys_are_forgotten_each_rank_its_own_and_rank_0_the_common_ones():
    """A fault's keys (the interruption's record, the barrier, a gathering rank assignment's
    keys) go once every rank is two iterations on: the store ends where it began."""
    store = HashStore()
    store.set(CURRENT_KEY, "0")
    before = store.num_keys()
    ranks = [Iteration(store, 3, world_size=2) for _ in range(2)]
    ranks[1].interrupt(Interruption(1, "EXCEPTION", "RuntimeError: x", at=10.0))
    for rank, it in enumerate(ranks):
        it.arrive(rank)
    phase = dist.PrefixStore("ra/3", store)  # the assignment at the end of iteration 3

    def assign(rank: int) -> None:  # two gathers, as a `Tree` assignment makes
        ctx = RankAssignmentCtx(State(rank=rank, world_size=2), phase, set())
        for value in ("a", "b"):
            gather_keys(ctx, value, datetime.timedelta(seconds=10))

    threads = [threading.Thread(target=assign, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert store.num_keys() > before
    forget_iteration(store, 3, 1)
    forget_iteration(store, 3, 0)
    assert store.num_keys() == before
    forget_iteration(store, 3, 0)  # again, or an iteration nobody interrupted: nothing to do
    forget_iteration(store, 4, None)
    assert store.num_keys() == before


def test_nvrx_arguments_are_checked_as_nvrx_checks_them():
    with pytest.raises(TypeError, match="soft_timeout"):
        build_options({"soft_timeout": 60})
    with pytest.raises(ValueError, match="soft_timeout < hard_timeout"):
        build_options({"soft_timeout": datetime.timedelta(seconds=100)})
    with pytest.raises(TypeError, match="unexpected keyword"):
        build_options({"monitor_interval": 1})
    with pytest.raises(ValueError, match="FTRUN_INPROCESS_ABORT_TIMEOUT"):
        build_options({}, environ={"FTRUN_INPROCESS_ABORT_TIMEOUT": "soon"})


def test_arguments_ftrun_does_not_need_warn_once_with_the_reason():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_options({"monitor_process_interval": datetime.timedelta(seconds=2),
                       "heartbeat_interval": datetime.timedelta(seconds=1)})  # fmt: skip
    assert [str(w.message) for w in caught] == [
        "ftrun.inprocess.Wrapper: monitor_process_interval is not used: ftrun runs no monitor "
        "process"
    ]  # the second is NVRx's default: nothing to say


def test_the_call_wrapper_goes_to_the_parameter_annotated_for_it():
    class CallWrapper:
        pass

    def train(model: int, call_wrapper: CallWrapper | None = None, *, lr: float = 0.1) -> None:
        return None

    marker = CallWrapper()
    args, kwargs = substitute_call_wrapper(train, (7,), {"lr": 0.2}, marker)
    assert (args, kwargs) == ((7, marker), {"lr": 0.2})


def test_a_gloo_group_is_pinned_for_good_and_its_connections_shut_down_at_a_restart():
    assert not pin_gloo_groups()  # no group: nothing pinned, no connection shut down
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        held = sys.getrefcount(group)
        assert pin_gloo_groups()
        assert sys.getrefcount(group) == held + 1  # a reference nothing releases
    finally:
        dist.destroy_process_group()
    assert not pin_gloo_groups()


class _GatedIteration:
    """An iteration whose end the watcher sees only when the test says so (a watcher thread
    that the scheduler left behind, under load)."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.gate = threading.Event()
        self.watched = threading.Event()

    def wait_end(self) -> bool:
        self.watched.set()
        return self.gate.wait(10)

    def was_interrupted(self) -> bool:
        return True


class _FakeInterrupter:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.armed = False
        self.interrupts = 0

    def interrupt(self) -> bool:
        self.interrupts += 1
        self.armed = False
        return True


def test_a_watcher_that_sees_an_iteration_end_late_leaves_the_next_one_alone():
    """Seen under `make test`'s load: a watcher saw iteration 11's end only after the main
    thread had moved on to 12 and armed, and interrupted 12 (its rank never ran 12; the peer
    waited 30 s for it). The end of an iteration the main thread has left stops nothing."""
    interrupter, aborts = _FakeInterrupter(), []
    watcher = Watcher(interrupter, abort=lambda: aborts.append(1))  # type: ignore[arg-type]
    try:
        old, new = _GatedIteration(11), _GatedIteration(12)
        watcher.follow(old)  # type: ignore[arg-type]
        assert old.watched.wait(10)
        watcher.follow(new)  # type: ignore[arg-type]  # the main thread follows 12, then arms
        interrupter.armed = True
        old.gate.set()  # and only now does the watcher see 11's end
        assert new.watched.wait(10)
        assert (interrupter.interrupts, aborts, watcher.aborted.is_set()) == (0, [], False)
        new.gate.set()  # 12's own end still stops the main thread
        wait_for(lambda: interrupter.interrupts == 1, 10, "the interrupt for iteration 12")
        assert aborts == [1] and watcher.aborted.is_set()
    finally:
        old.gate.set()
        new.gate.set()
        watcher.close()
