"""The etcd client's decisions, without etcd: which member a launcher's client asks, when the
launch's lease is refreshed, and by which client."""

from __future__ import annotations

import logging

import pytest

from ftrun.store.etcd_lease import JobLease
from ftrun.store.etcd_members import MemberHealth, spread_start

MEMBERS = ["m0:2379", "m1:2379", "m2:2379"]


def test_a_client_starts_on_the_first_member_from_its_pick_that_no_client_saw_go_away(
    caplog: pytest.LogCaptureFixture,
):
    health = MemberHealth()
    assert [health.first_answering(MEMBERS, i) for i in range(4)] == [0, 1, 2, 0]
    with caplog.at_level(logging.INFO, logger="ftrun.rendezvous"):
        health.mark_down("m1:2379", ConnectionError())
        health.mark_down("m1:2379", ConnectionError())  # another client: no second line
        assert health.first_answering(MEMBERS, 1) == 2
        health.mark_down("m2:2379", TimeoutError())
        assert health.first_answering(MEMBERS, 1) == 0
        health.mark_down("m0:2379", ConnectionError())
        assert health.first_answering(MEMBERS, 1) == 1  # none answers: its own pick (may be back)
        health.mark_up("m2:2379")
        health.mark_up("m2:2379")
        assert health.first_answering(MEMBERS, 0) == 2
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "etcd member m1:2379 does not answer (ConnectionError); using the others",
        "etcd member m2:2379 does not answer (TimeoutError); using the others",
        "etcd member m0:2379 does not answer (ConnectionError); using the others",
        "etcd member m2:2379 answers again",
    ]
    assert {spread_start(3, pid) for pid in range(30)} == {0, 1, 2}


def test_the_lease_is_refreshed_by_one_client_every_third_of_its_ttl():
    now = [100.0]
    lease = JobLease(7, ttl_s=600, clock=lambda: now[0])
    assert not lease.take_refresh()  # just granted or read
    now[0] += 199
    assert not lease.take_refresh()
    now[0] += 1
    assert lease.take_refresh()  # 200 s on: this caller refreshes ...
    assert not lease.take_refresh()  # ... and the launcher's other clients do not
    now[0] += 200
    assert lease.take_refresh()
