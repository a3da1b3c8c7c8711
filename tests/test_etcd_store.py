"""The etcd store keeps TCPStore's semantics (what the rendezvous and the agent rely on): the
same assertions on both, against a real 3-member etcd cluster on 127.0.0.1; and it survives a
member going away."""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from torch.distributed import DistStoreError, TCPStore

from ftrun.errors import (
    ExitCode,
    RendezvousAuthError,
    RendezvousFailedError,
    RendezvousPrefixHeldError,
)
from ftrun.rendezvous.control import job_control
from ftrun.store.connect import connect_etcd
from ftrun.store.etcd_members import spread_start
from ftrun.store.etcd_store import EtcdStore
from ftrun.store.etcd_wire import WatchInterruptedError

SHORT = datetime.timedelta(seconds=1)


def endpoints(cluster: Any) -> list[tuple[str, int]]:
    return [("127.0.0.1", m.client_port) for m in cluster.members]


def follower(cluster: Any) -> int:
    """The index of a member that is not the leader."""
    return next(i for i, member in enumerate(cluster.members) if not member.leads())


@pytest.fixture(params=["tcp", "etcd"])
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """Two clients of one store (a TCPStore client serves one request at a time)."""
    if request.param == "tcp":
        one = TCPStore("127.0.0.1", 0, is_master=True, timeout=SHORT, use_libuv=True)
        yield one, TCPStore("127.0.0.1", one.port, is_master=False, timeout=SHORT)
    else:
        cluster = request.getfixturevalue("etcd_cluster")
        yield (
            EtcdStore(endpoints(cluster), "job", SHORT),
            EtcdStore(endpoints(cluster), "job", SHORT),
        )


@pytest.fixture
def store(stores: tuple[Any, Any]) -> Any:
    return stores[0]


def test_set_get_check_and_multi_get(store: Any) -> None:
    assert not store.check(["a"])
    store.set("a", "1")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"1" and store.check(["a", "b"]) and not store.check(["a", "c"])
    assert store.multi_get(["b", "a"]) == [b"\x00\xff", b"1"]


def test_many_keys_at_once(store: Any) -> None:
    keys = [f"node/{i}" for i in range(300)]  # more than etcd's 128 operations a transaction
    for key in keys:
        store.set(key, key)
    assert store.check(keys) and store.multi_get(keys) == [k.encode() for k in keys]
    assert not store.check([*keys, "node/2x"])
    for i in range(700):  # more keys between theirs than theirs: no longer one range read
        store.set(f"node/1/{i}", "")
    assert store.check(keys) and store.multi_get(keys) == [k.encode() for k in keys]
    assert not store.check([*keys, "node/2x"])


def test_get_and_wait_block_until_the_key_exists_then_time_out(stores: tuple[Any, Any]) -> None:
    store, other = stores
    threading.Timer(0.2, other.set, ("late", "x")).start()
    assert store.get("late") == b"x"
    store.wait(["late"])
    with pytest.raises(DistStoreError):
        store.get("never")
    with pytest.raises(DistStoreError):
        store.wait(["never"], datetime.timedelta(seconds=0.2))


class Requests:
    """Counts the HTTP requests made from one thread (an EtcdStore makes one per etcd call, a
    watch included) and says when a watch has been opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.thread: threading.Thread | None = None
        self.urls: list[str] = []
        self.watching = threading.Event()
        request = requests.Session.request

        def counted(session: requests.Session, method: str, url: str, **kwargs: Any) -> Any:
            mine = threading.current_thread() is self.thread
            if mine:
                self.urls.append(url)
            answer = request(session, method, url, **kwargs)
            if mine and url.endswith("/watch"):
                self.watching.set()  # the stream is open: etcd has taken the watch
            return answer

        monkeypatch.setattr(requests.Session, "request", counted)

    def calls(self) -> list[str]:
        """What each counted request asked for: `txn`, `watch`, `put`, ..."""
        return [url.rsplit("/", 1)[1] for url in self.urls]

    def run(self, call: Any) -> tuple[threading.Thread, dict[str, Any]]:
        """`call()` in a thread of its own, counted; its result and when it returned, once
        joined."""
        out: dict[str, Any] = {}

        def target() -> None:
            out["value"] = call()
            out["at"] = time.monotonic()

        self.thread = threading.Thread(target=target)
        self.thread.start()
        return self.thread, out


def two_stores(cluster: Any) -> list[EtcdStore]:
    return [EtcdStore(endpoints(cluster), "job", datetime.timedelta(seconds=30)) for _ in "ab"]


def test_a_blocked_get_wakes_on_the_set_with_a_watch_not_polls(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = two_stores(etcd_cluster)
    counted = Requests(monkeypatch)
    thread, out = counted.run(lambda: store.get("late"))
    assert counted.watching.wait(10)
    thread.join(0.5)  # blocked a while on purpose: a poll would show as requests meanwhile
    assert thread.is_alive()
    other.set("late", "x")
    set_at = time.monotonic()
    thread.join(10)
    assert out["value"] == b"x" and out["at"] - set_at < 0.1, out["at"] - set_at
    assert counted.calls() == ["txn", "watch"]  # the watch's event carried the value


def test_a_value_handed_over_by_the_watch_is_what_a_read_returns(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A counter's event carries its marker: the get returns the count, as a read would; a
    wait that times out says None through `get_within`."""
    store, other = two_stores(etcd_cluster)
    counted = Requests(monkeypatch)
    thread, out = counted.run(lambda: store.get("count"))
    assert counted.watching.wait(10)
    other.add("count", 5)
    thread.join(10)
    assert out["value"] == b"5" == store.get("count")
    assert store.get_within("never", 0.2) is None
    other.set("empty", "")
    assert store.get_within("empty", 5) == b""


def test_an_arrival_looks_at_the_close_so_that_its_wait_reads_nothing_first(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A barrier node's round: one read (shutdown and cycle), its arrival with a look at the
    # close, and the watch that hands the close over. A close put between the arrival and the
    # watch is replayed from the arrival's revision, not missed.
    store, other = two_stores(etcd_cluster)
    other.set("cycle", "3")
    assert other.add_then_wait_on("arrivals", "closed") == 1  # the first arrival
    counted = Requests(monkeypatch)
    counted.thread = threading.current_thread()
    assert store.read_now(["shutdown", "cycle"]) == [None, b"3"]
    assert store.add_then_wait_on("arrivals", "closed") == 2
    closer = threading.Thread(target=other.set, args=("closed", "round"))  # not counted
    closer.start()
    closer.join()
    assert store.get_within("closed", 5) == b"round"
    assert counted.calls() == ["txn", "txn", "watch"]
    assert other.add_then_wait_on("arrivals", "closed") == 3  # closed already: the wait reads
    assert other.get_within("closed", 5) == b"round"


def test_a_waiting_node_looks_at_shutdown_and_the_counts_in_one_request(
    stores: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every few seconds of a round that does not close: 1 request on etcd, the same answers as
    # TCPStore's 4 (an absent counter counts 0).
    store, other = stores
    control, theirs = job_control(store, "job"), job_control(other, "job")
    counters = [f"{control.prefix}/c0/{name}" for name in ("arrivals", "unhealthy", "beat")]
    other.add(counters[0], 1)
    other.add(counters[0], 1)
    other.add(counters[2], 1)
    if isinstance(store, EtcdStore):
        counted = Requests(monkeypatch)
        counted.thread = threading.current_thread()
    assert control.shutdown_and_counts(counters) == (None, [2, 0, 1])
    if isinstance(store, EtcdStore):
        assert counted.calls() == ["txn"]
    theirs.shutdown(ExitCode.SUCCESS, "done", 0)
    shutdown, counts = control.shutdown_and_counts(counters)
    assert shutdown is not None and shutdown.reason == "done" and counts == [2, 0, 1]


def test_waiting_again_after_a_timeout_replays_what_was_put_meanwhile(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = two_stores(etcd_cluster)
    counted = Requests(monkeypatch)
    counted.thread = threading.current_thread()
    with pytest.raises(DistStoreError, match=r"wait timeout after 0\.2s"):
        store.wait(["k"], datetime.timedelta(seconds=0.2))
    setter = threading.Thread(target=other.set, args=("k", "x"))  # not counted: its own thread
    setter.start()
    setter.join()
    store.wait(["k"], datetime.timedelta(seconds=0.2))  # the watch from the first read's revision
    assert store.get("k") == b"x"
    # A wait reads nothing after its watch saw the put: the get is the one read after it.
    assert counted.calls() == ["txn", "watch", "watch", "txn"]


def test_a_member_lost_mid_watch_hands_the_watch_to_the_next(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A follower: losing the leader would also cost the setter a write lost in the election.
    lost = follower(etcd_cluster)
    addresses = endpoints(etcd_cluster)
    others = [a for i, a in enumerate(addresses) if i != lost]
    store = EtcdStore([addresses[lost], *others], "job", datetime.timedelta(seconds=30))
    counted = Requests(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="ftrun.rendezvous"):
        thread, out = counted.run(lambda: store.get("late"))
        assert counted.watching.wait(10)
        etcd_cluster.kill(lost)  # the member holding the watch
        EtcdStore(others, "job", datetime.timedelta(seconds=30)).set("late", "x")
        thread.join(30)
    assert out["value"] == b"x"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "does not answer" in lines[0], lines


def test_a_wait_longer_than_the_store_timeout_survives_a_member_lost_late(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's timeout (1 s) is how long no member may answer, not how long a watch may
    last: a member lost 1.5 s into a 10 s wait hands the watch on."""
    lost = follower(etcd_cluster)
    addresses = endpoints(etcd_cluster)
    others = [a for i, a in enumerate(addresses) if i != lost]
    store = EtcdStore([addresses[lost], *others], "job", SHORT)
    counted = Requests(monkeypatch)
    thread, out = counted.run(lambda: store.wait(["late"], datetime.timedelta(seconds=10)))
    assert counted.watching.wait(10)
    thread.join(1.5)  # past the store's timeout, on purpose
    etcd_cluster.kill(lost)
    EtcdStore(others, "job", SHORT).set("late", "x")
    thread.join(10)
    assert "at" in out, "the wait raised"


def test_add_is_atomic(stores: tuple[Any, Any]) -> None:
    store = stores[0]
    assert store.add("n", 0) == 0
    threads = [threading.Thread(target=lambda s=s: [s.add("n", 1) for _ in range(20)])
               for s in stores]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.add("n", 0) == 40 and store.get("n") == b"40"


class CountingEtcdStore(EtcdStore):
    """Counts its transactions (each is one request while the members answer)."""

    txns = 0

    def _txn(self, *args: Any) -> dict[str, Any]:
        self.txns += 1
        return super()._txn(*args)


def test_arrivals_at_once_cost_each_a_few_requests_not_one_per_rival(etcd_cluster: Any) -> None:
    stores = [CountingEtcdStore(endpoints(etcd_cluster), "job", SHORT) for _ in range(12)]
    start = threading.Barrier(len(stores))
    counts: list[int] = []

    def arrive(store: EtcdStore) -> None:
        start.wait(10)
        counts.append(store.add("arrivals", 1))

    threads = [threading.Thread(target=arrive, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(counts) == list(range(1, len(stores) + 1))
    # The first put of the marker (absent), its creation (lost, but for one), the put again.
    assert max(s.txns for s in stores) <= 3, [s.txns for s in stores]


def test_counters_mix_with_every_other_operation(store: Any) -> None:
    """etcd keeps a counter as a marker whose count is the key's version: no reader may see
    it, and a counter that `set`, `compare_set` or `append` rewrote counts on from there."""
    assert store.add("c", 1) == 1 and store.add("c", 1) == 2 and store.add("c", 0) == 2
    assert store.get("c") == b"2" and store.multi_get(["c", "c"]) == [b"2", b"2"]
    assert store.compare_set("c", "", "x") == b"2"  # present: the count, not the marker
    assert store.compare_set("c", "1", "x") == b"2"
    assert store.compare_set("c", "2", "7") == b"7"  # expected: the count
    assert store.add("c", 1) == 8 and store.add("c", 5) == 13 and store.add("c", 1) == 14
    store.set("c", "10")
    assert store.add("c", 1) == 11 and store.add("c", -20) == -9 and store.add("c", 1) == -8
    store.append("c", "0")
    assert store.get("c") == b"-80" and store.add("c", 1) == -79
    assert store.add("z", 0) == 0 and store.get("z") == b"0" and store.add("z", 1) == 1
    assert store.add("five", 5) == 5 and store.add("five", 1) == 6
    assert store.delete_key("five") and not store.check(["five"]) and store.add("five", 1) == 1
    assert store.compare_set("five", "1", "one") == b"one" and store.get("five") == b"one"


def test_set_and_compare_set_racing_increments_lose_none(stores: tuple[Any, Any]) -> None:
    store, other = stores
    store.add("n", 1)
    adds = threading.Thread(target=lambda: [store.add("n", 1) for _ in range(30)])
    adds.start()
    moved = 0  # compare_sets that took the count from `seen` to `seen + 100` (any number)
    while adds.is_alive():
        seen = other.get("n")
        if other.compare_set("n", seen, str(int(seen) + 100)) == str(int(seen) + 100).encode():
            moved += 1
    adds.join()
    assert store.add("n", 0) == 31 + 100 * moved


def test_compare_set_as_tcpstore_does(store: Any) -> None:
    assert store.compare_set("k", "", "first") == b"first"  # absent, expected empty: created
    assert store.compare_set("k", "", "second") == b"first"  # present: the current value
    assert store.compare_set("k", "first", "third") == b"third"
    assert store.compare_set("k", "nope", "fourth") == b"third"
    assert store.compare_set("absent", "x", "y") == b"x"  # absent, expected set: TCPStore's


def test_append_concatenates(store: Any) -> None:
    store.append("log", b"a\n")
    store.append("log", "b\n")
    assert store.get("log") == b"a\nb\n"


def test_jobs_sharing_one_etcd_do_not_see_each_other(etcd_cluster: Any) -> None:
    one, two = (EtcdStore(endpoints(etcd_cluster), job, SHORT) for job in ("one", "two"))
    one.set("cycle", "5")
    assert not two.check(["cycle"])
    assert two.compare_set("cycle", "", "0") == b"0" and one.get("cycle") == b"5"


def test_launchers_start_on_different_members(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each launcher asks first the member its process id picks (`spread_start`), so the
    members share the job's nodes; every client of one launcher picks the same one."""
    assert [spread_start(3, pid) for pid in (300, 301, 302, 303)] == [0, 1, 2, 0]
    assert spread_start(3) == spread_start(3)
    addresses = endpoints(etcd_cluster)
    counted = Requests(monkeypatch)
    for first in range(len(addresses)):
        store = EtcdStore(addresses, "spread", datetime.timedelta(seconds=10), first_member=first)
        counted.urls.clear()
        thread, _ = counted.run(lambda: store.set("k", "v"))  # noqa: B023 (joined at once)
        thread.join(10)
        [url] = counted.urls
        assert f":{addresses[first][1]}/" in url


def test_a_member_that_goes_away_costs_one_log_line(
    etcd_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # A follower: etcd loses a write proposed while its followers still take a killed leader
    # for alive, and the writer waits out its request timeout on a member that is up.
    lost = follower(etcd_cluster)
    addresses = endpoints(etcd_cluster)
    addresses.insert(0, addresses.pop(lost))
    store = EtcdStore(addresses, "job", datetime.timedelta(seconds=10))
    store.set("k", "1")
    etcd_cluster.kill(lost)  # the member the store was using
    with caplog.at_level(logging.WARNING, logger="ftrun.rendezvous"):
        for i in range(5):
            assert store.add("k", 1) == 2 + i
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "does not answer" in lines[0], lines


def test_the_clients_of_one_launcher_say_a_member_went_away_once_and_then_avoid_it(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The agent's client and the ones its threads make (the restart watch: one a cycle) share
    # what they saw: one line a launcher, and a client made later starts on a member that is up.
    lost = follower(etcd_cluster)
    addresses = endpoints(etcd_cluster)
    one = EtcdStore(addresses, "job", datetime.timedelta(seconds=10), first_member=lost)
    other = EtcdStore(addresses, "job", one.timeout, first_member=lost, health=one.health)
    one.set("k", "1")
    etcd_cluster.kill(lost)
    with caplog.at_level(logging.WARNING, logger="ftrun.rendezvous"):
        assert one.add("k", 1) == 2 and other.add("k", 1) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "does not answer" in lines[0], lines
    counted = Requests(monkeypatch)
    later = EtcdStore(addresses, "job", one.timeout, first_member=lost, health=one.health)
    thread, _ = counted.run(lambda: later.set("k", "v"))
    thread.join(10)
    [url] = counted.urls
    assert f":{addresses[lost][1]}/" not in url


def test_members_that_accept_but_never_answer_cost_the_timeout_not_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]  # mute "members"
    try:
        mute = [("127.0.0.1", s.getsockname()[1]) for s in listeners]
        store = EtcdStore(mute, "job", datetime.timedelta(seconds=1))
        started = time.monotonic()
        with (
            caplog.at_level(logging.WARNING, logger="ftrun.rendezvous"),
            pytest.raises(DistStoreError, match="no etcd member answered for 1s"),
        ):
            store.set("k", "1")
        assert time.monotonic() - started < 2.5
        said = {r.getMessage().split()[2] for r in caplog.records}
        assert said <= {f"127.0.0.1:{p}" for _, p in mute}  # each member at most once, in turn
    finally:
        for listener in listeners:
            listener.close()


def test_a_request_refused_as_too_many_is_sent_again_and_applied_once(
    etcd_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd's backpressure (16,384 nodes arriving at once): the refusal comes before the
    proposal, so the store sends the request again after its back-off, and an add counts once."""
    store = EtcdStore(endpoints(etcd_cluster), "job", datetime.timedelta(seconds=10))
    store.set("warm", "1")  # the store's first look at its members, not refused
    refusals = {"left": 4}
    request = requests.Session.request

    def overloaded(session: requests.Session, method: str, url: str, **kwargs: Any) -> Any:
        if url.endswith("/kv/txn") and refusals["left"] > 0:
            refusals["left"] -= 1
            answer = requests.Response()
            answer.status_code, answer.reason = 500, "Internal Server Error"
            answer._content = json.dumps({"error": "etcdserver: too many requests",
                                          "message": "etcdserver: too many requests",
                                          "code": 2}).encode()  # fmt: skip
            return answer
        return request(session, method, url, **kwargs)

    monkeypatch.setattr(requests.Session, "request", overloaded)
    assert store.add("arrivals", 1) == 1
    assert refusals["left"] == 0
    monkeypatch.setattr(requests.Session, "request", request)
    assert store.add("arrivals", 0) == 1


def test_no_member_answering_is_a_one_line_error(etcd_cluster: Any) -> None:
    store = EtcdStore(endpoints(etcd_cluster), "job", datetime.timedelta(seconds=0.5))
    etcd_cluster.stop()
    with pytest.raises(DistStoreError) as info:
        store.set("k", "1")
    assert "no etcd member answered for 0.5s" in str(info.value)
    assert "\n" not in str(info.value)


# ---- connecting: one-line errors, and whose keys these are ---------------------------------


def test_an_unreachable_etcd_is_a_one_line_error_that_may_be_relaunched(etcd_cluster: Any):
    endpoint = etcd_cluster.endpoints
    etcd_cluster.stop()
    with pytest.raises(RendezvousFailedError) as info:
        connect_etcd(endpoint, "job", SHORT, {})
    assert str(info.value).startswith(f"cannot reach etcd at {endpoint}: no etcd member answered")
    assert "\n" not in str(info.value) and info.value.exit_code == ExitCode.FAILED


def test_a_prefix_held_by_another_slurm_job_is_refused(etcd_cluster: Any):
    mine = {"SLURM_JOB_ID": "100", "SLURM_RESTART_COUNT": "0"}
    first = connect_etcd(etcd_cluster.endpoints, "job", SHORT, mine)
    connect_etcd(etcd_cluster.endpoints, "job", SHORT, mine)  # another node of the same job
    with pytest.raises(RendezvousPrefixHeldError) as info:
        connect_etcd(etcd_cluster.endpoints, "job", SHORT, {**mine, "SLURM_JOB_ID": "200"})
    assert str(info.value) == (
        "etcd prefix /ftrun/job/0/ is held by Slurm job 100, not this one (200): give this job "
        "another --rdzv-id"
    )
    assert info.value.exit_code == ExitCode.USAGE
    first.set("cycle", "7")  # a requeued run (same job id, restart 1) starts with no keys
    requeued = connect_etcd(
        etcd_cluster.endpoints, "job", SHORT, {**mine, "SLURM_RESTART_COUNT": "1"}
    )
    assert not requeued.check(["cycle"])


def _enable_etcd_auth(member: str) -> None:
    """What `etcdctl user add root:secret && etcdctl auth enable` does, through etcd's own JSON
    gateway: no etcdctl (Debian's etcd-client) needed on the machine."""
    steps = (
        ("user/add", {"name": "root", "password": "secret"}),
        ("role/add", {"name": "root"}),
        ("user/grant", {"user": "root", "role": "root"}),
        ("enable", {}),
    )
    for path, body in steps:
        request = urllib.request.Request(
            f"http://{member}/v3/auth/{path}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200, (path, answer.read())


def test_an_etcd_that_wants_a_password_is_a_usage_error(etcd_cluster: Any):
    member = etcd_cluster.members[0].endpoint
    _enable_etcd_auth(member)
    with pytest.raises(RendezvousAuthError) as info:
        connect_etcd(member, "job", SHORT, {"SLURM_JOB_ID": "1"})
    assert str(info.value).startswith(f"etcd at {member} refused: ")
    assert "\n" not in str(info.value) and info.value.exit_code == ExitCode.USAGE


def test_an_interrupt_from_another_thread_ends_a_wait_at_once_and_blames_no_member(
    etcd_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = EtcdStore(endpoints(etcd_cluster), "job", datetime.timedelta(seconds=30))
    out: dict[str, Any] = {}

    def wait() -> None:
        try:
            store.wait(["never"])
        except DistStoreError as exc:
            out["error"] = exc

    waiter = threading.Thread(target=wait)
    with caplog.at_level(logging.WARNING, logger="ftrun.rendezvous"):
        waiter.start()
        waiter.join(0.5)  # in its watch by now
        started = time.monotonic()
        store.interrupt()
        waiter.join(5)
    assert time.monotonic() - started < 2.0  # the interrupt, not the store's 30 s timeout
    assert isinstance(out["error"], WatchInterruptedError)
    assert "timeout" not in str(out["error"])  # not a wait that ran out
    assert not caplog.records  # no member "does not answer"
    with pytest.raises(WatchInterruptedError):
        store.set("k", "v")  # the client is done
