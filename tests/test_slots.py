"""Who takes which slot of a barrier round, and the job's progress record: decisions, no store."""

from __future__ import annotations

import pytest

from ftrun.rendezvous.errors import DescriptorVersionError, InfraRankError
from ftrun.rendezvous.published import Progress, PublishedRound
from ftrun.rendezvous.ranks import NodeDescriptor
from ftrun.rendezvous.slots import Arrival, RoundView, plan_round


def arrivals(*names: str, infra: list[int] | None = None) -> tuple[Arrival, ...]:
    ranks = infra or [None] * len(names)
    return tuple(
        Arrival(i, name, rank) for i, (name, rank) in enumerate(zip(names, ranks, strict=True))
    )


def names(plan: tuple[Arrival, ...] | None) -> list[str] | None:
    return None if plan is None else [a.node for a in plan]


def view(*came: str, **kw: object) -> RoundView:
    fields: dict[str, object] = {"max_nodes": 2, "min_nodes": 2, "arrivals": arrivals(*came)}
    return RoundView(**{**fields, **kw})  # type: ignore[arg-type]


def test_first_round_takes_the_first_arrivals_and_the_rest_stand_by():
    assert names(plan_round(view("a", "b", "s"))) == ["a", "b"]
    assert plan_round(view("a")) is None


def test_the_last_rounds_nodes_keep_their_slots_whatever_the_arrival_order():
    assert names(plan_round(view("s", "b", "a", owners=("a", "b")))) == ["a", "b"]


def test_a_late_owner_is_waited_for_until_the_last_call():
    assert plan_round(view("a", "s", owners=("a", "b"))) is None
    assert names(plan_round(view("a", "s", owners=("a", "b"), last_call_over=True))) == ["a", "s"]


def test_a_gone_owner_gives_its_slot_to_a_spare_at_once_keeping_the_others_ranks():
    plan = plan_round(view("b", "s", owners=("a", "b"), gone=frozenset({"a"})))
    assert names(plan) == ["s", "b"]


def test_without_a_spare_an_elastic_round_closes_up_once_nobody_else_can_come():
    shrink = {"max_nodes": 3, "min_nodes": 2, "owners": ("a", "b", "c"), "gone": frozenset("b")}
    assert plan_round(view("c", "a", **shrink)) is None  # a spare may still come
    assert names(plan_round(view("c", "a", **shrink, capacity=2))) == ["a", "c"]
    assert names(plan_round(view("c", "a", **shrink, last_call_over=True))) == ["a", "c"]


def test_below_the_minimum_nobody_closes():
    gone = frozenset({"a", "b"})
    assert plan_round(view("s", owners=("a", "b"), gone=gone, last_call_over=True)) is None


def test_infra_ranks_own_the_first_rounds_slots_and_order_the_spares():
    came = arrivals("n2", "n1", "n3", "n0", infra=[2, 1, 3, 0])
    base = RoundView(max_nodes=2, min_nodes=2, arrivals=came[:3], owners=(0, 1), by_infra=True)
    assert plan_round(base) is None  # infra rank 0 is not there yet
    assert names(plan_round(RoundView(**{**base.__dict__, "arrivals": came}))) == ["n0", "n1"]
    # rank 0 never came: the lowest spare infra rank takes its slot after the last call
    late = RoundView(**{**base.__dict__, "last_call_over": True})
    assert names(plan_round(late)) == ["n2", "n1"]


def test_a_node_arriving_twice_takes_one_slot():
    assert names(plan_round(view("a", "a", "b", owners=("a", "b")))) == ["a", "b"]


@pytest.mark.parametrize(
    ("before", "reports", "after"),
    [
        (Progress(), [None, None], Progress()),  # never reported: not judged
        (Progress(), [3, 5], Progress(5, 0)),
        (Progress(5, 0), [5, None], Progress(5, 1)),
        (Progress(5, 1), [], Progress(5, 2)),  # every node of the cycle was lost
        (Progress(5, 2), [6], Progress(6, 0)),
    ],
)
def test_progress_counts_cycles_that_do_not_pass_the_best(before, reports, after):
    assert before.after(reports) == after


def descriptor(name: str, infra: int | None = None) -> NodeDescriptor:
    return NodeDescriptor(name, "127.0.0.1", 1, 1, infra, 0)


def test_a_published_round_tells_each_arrival_its_slot_or_that_it_stands_by():
    rows = (descriptor("b").to_row(), descriptor("a").to_row())
    published = PublishedRound.decode(PublishedRound(rows, (2, 0), ("s",), Progress(7, 1)).encode())
    rnd = published.round_for(4, 0)
    assert rnd is not None and rnd.me.node == "a" and rnd.group_rank == 1
    assert (rnd.standby, rnd.stalled_cycles, rnd.number) == (("s",), 1, 4)
    assert published.round_for(4, 1) is None


def test_a_published_error_fails_participants_and_standbys_alike():
    bad = PublishedRound((descriptor("a").to_row(),), (0,), error="nodes a and b both have 0")
    for index in (0, 1):
        with pytest.raises(InfraRankError, match="both have 0"):
            bad.round_for(0, index)


def test_a_round_closed_by_an_older_release_is_refused_clearly():
    import json
    import zlib

    old = zlib.compress(json.dumps([descriptor("a").to_row()]).encode())
    with pytest.raises(DescriptorVersionError, match="older than 3"):
        PublishedRound.decode(old)
