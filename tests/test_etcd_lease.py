"""A launch's keys on etcd go with it: one lease per launch, kept alive by the launchers' own
requests (a real 3-member etcd cluster on 127.0.0.1)."""

from __future__ import annotations

import base64
import datetime
import time
from typing import Any

import pytest
import requests
from torch.distributed import DistStoreError

from ftrun.config.store import StoreConfig
from ftrun.store.connect import another_client, connect_etcd
from ftrun.store.etcd_lease import JobLease
from support import wait_for

TIMEOUT = datetime.timedelta(seconds=5)


def leased_keys(cluster: Any, lease_id: int) -> tuple[int, list[bytes]]:
    """The lease's TTL left in whole seconds (-1: gone; the gateway leaves out a 0) and the
    keys attached to it, as etcd says."""
    url = f"http://{cluster.members[0].endpoint}/v3/lease/timetolive"
    answer = requests.post(url, json={"ID": lease_id, "keys": True}, timeout=10).json()
    return int(answer.get("TTL", 0)), [base64.b64decode(k) for k in answer.get("keys", [])]


def test_the_launchers_of_a_launch_share_one_lease_and_every_key_is_attached(etcd_cluster: Any):
    first = connect_etcd(etcd_cluster.endpoints, "job", TIMEOUT, {"SLURM_JOB_ID": "7"})
    second = connect_etcd(etcd_cluster.endpoints, "job", TIMEOUT, {"SLURM_JOB_ID": "7"})
    config = StoreConfig(endpoint=etcd_cluster.endpoints, run_id="job", backend="etcd")
    thread_client = another_client(first, config, {"SLURM_JOB_ID": "7"})
    assert isinstance(first.lease, JobLease)
    assert first.lease.id == second.lease.id and thread_client.lease is first.lease
    first.set("k", "v")
    second.add("count", 1)
    thread_client.compare_set("cas", "", "x")
    first.append("log", "a")
    ttl, keys = leased_keys(etcd_cluster, first.lease.id)
    assert 0 < ttl <= 600
    names = {k.decode().removeprefix("/ftrun/job/0/") for k in keys}
    assert names == {"lease", "owner", "k", "count", "cas", "log"}


def test_a_launch_whose_launchers_stopped_loses_its_keys_within_the_ttl(etcd_cluster: Any):
    store = connect_etcd(etcd_cluster.endpoints, "short", TIMEOUT, {}, lease_ttl_s=2)
    store.set("k", "v")
    lease = store.lease.id
    # While a launcher uses the store, its requests keep the lease alive past the TTL.
    until = time.monotonic() + 5
    while time.monotonic() < until:
        assert store.get("k") == b"v"
        time.sleep(0.2)  # a launcher's pace: requests every few tenths of a second
    assert leased_keys(etcd_cluster, lease)[0] >= 0
    # Then nobody asks: etcd deletes the keys once the TTL runs out.
    wait_for(lambda: leased_keys(etcd_cluster, lease)[0] == -1, 15, "the lease to expire", 0.2)
    other = connect_etcd(etcd_cluster.endpoints, "short", TIMEOUT, {}, lease_ttl_s=2)
    assert not other.check(["k"]) and other.lease.id != lease
    with pytest.raises(DistStoreError, match=f"the job's etcd lease {lease} expired"):
        store.set("k", "again")
