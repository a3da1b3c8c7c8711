"""Naming the collective a rank never entered, from real flight-recorder dumps
(tests/data/flight: two gloo ranks under torch 2.13, rank 1 skipped the 5th collective, each
dumped with torch's JSON call while the other waited; and two NCCL ranks on the device's two
H200s under ft_launcher, torch 2.11, rank 1 skipping the 10th all_reduce of
tests/workers/collective_worker.py --backend nccl)."""

from __future__ import annotations

import json
from pathlib import Path

from ftrun.agent.decisions.collectives import RankCollectives, find_stalls, summarize

FLIGHT = Path(__file__).parent / "data" / "flight"


def dumps() -> list[RankCollectives]:
    found = [summarize(r, (FLIGHT / f"gloo-skip-rank{r}.json").read_bytes()) for r in (0, 1)]
    assert all(d is not None for d in found)
    return [d for d in found if d is not None]


def test_the_rank_that_skipped_is_named() -> None:
    [stall] = find_stalls(dumps(), range(2))
    assert (stall.op, stall.seq, stall.last_completed) == ("all_reduce", 5, 4)
    assert (stall.entered, stall.missing, stall.no_dump) == ((0,), (1,), ())
    assert stall.group == "default_pg" and stall.sizes == "[[4]]"
    assert stall.describe().startswith("rank(s) 1 never entered all_reduce seq 5")


def test_a_missing_dump_is_said_and_nobody_is_blamed_for_it() -> None:
    [stall] = find_stalls(dumps()[:1], range(2))
    assert stall.missing == () and stall.no_dump == (1,)
    assert "no dump from rank(s) 1" in stall.describe()


def test_ranks_that_all_completed_are_no_stall() -> None:
    done = summarize(0, (FLIGHT / "gloo-skip-rank1.json").read_bytes())
    assert done is not None
    assert find_stalls([done], [0]) == []


def test_every_rank_inside_and_none_done_blames_the_transport() -> None:
    rank0 = dumps()[0]
    twin = RankCollectives(1, rank0.groups)
    [stall] = find_stalls([rank0, twin], range(2))
    assert stall.missing == () and "the transport, not a rank" in stall.describe()


def test_summaries_travel_as_json_and_bad_ones_are_dropped() -> None:
    first = dumps()[0]
    assert RankCollectives.from_json(json.loads(json.dumps(first.to_json()))) == first
    assert RankCollectives.from_json({"rank": "x", "groups": {}}) is None
    assert RankCollectives.from_json({"groups": []}) is None


def test_a_dump_that_is_not_torchs_json_is_refused() -> None:
    for raw in (b"\x80\x04pickle", b"[]", b'{"entries": []}', b'{"pg_status": 3}'):
        assert summarize(0, raw) is None
    odd = summarize(0, b'{"pg_status": {"0": {"last_completed_collective": "x"}}}')
    assert odd is not None and odd.groups == {}


def test_nccl_dumps_name_the_rank_that_skipped() -> None:
    """NCCL's recorder leaves last_completed at -1 and marks its entries completed instead."""
    found = [summarize(r, (FLIGHT / f"nccl-skip-rank{r}.json").read_bytes()) for r in (0, 1)]
    [stall] = find_stalls([d for d in found if d is not None], range(2))
    assert (stall.op, stall.seq, stall.last_completed) == ("all_reduce", 10, 9)
    assert (stall.entered, stall.missing) == ((0,), (1,))
