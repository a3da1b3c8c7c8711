"""The live view's parts without processes: the node's view of its events, the metrics (parsed
with prometheus_client's own parser), the store feed (a HashStore), the job status, the page's
read-only server and `ftrun status`."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed import HashStore

from ftrun.eventlog.job_status import job_status, status_table
from ftrun.eventlog.node_view import ELSEWHERE, LAST_FAILURES, NodeState, NodeView
from ftrun.eventlog.reader import parse_line
from ftrun.observe import feed
from ftrun.observe.feed import FeedReader, FeedWriter
from ftrun.observe.metrics import NodeMetrics
from ftrun.observe.page import CachedStatus, serve
from ftrun.observe.service import FeedThread
from ftrun.observe.timings import RECOVERY_BOUNDS, NodeTimings
from ftrun.rank_monitor.protocol import Timeouts
from ftrun.rank_monitor.records import ProgressSnapshot
from ftrun.tools.cli import main as ftrun_main
from support import wait_for

NODES = ("n0", "n1")


def rec(event: str, ts: float, cycle: int = 0, node: str = "n0", **fields: Any) -> dict:
    return {"event": event, "ts": ts, "mono": ts, "node": node, "cycle": cycle, **fields}


def cycle_records(node: str, cycle: int, t: float, rank0: int, failure: str | None) -> list[dict]:
    """One cycle of one node: formed, started, stepping, then a failure and a restart."""
    ranks = [rank0, rank0 + 1]
    found = [
        rec("health_check", t, cycle, node, duration=0.1),
        rec("rendezvous_done", t + 0.5, cycle, node, duration=0.4, nodes=list(NODES),
            group_rank=NODES.index(node), world_size=4),
        rec("workers_started", t + 1, cycle, node, ranks=ranks, pids=[1, 2]),
        rec("stepping", t + 2, cycle, node, ranks=ranks, progress_ts=t + 2, progress_mono=t + 2),
    ]  # fmt: skip
    if failure is not None:
        found += [
            rec("failure", t + 9, cycle, node, kind=failure, detail="ValueError",
                key=f"{failure}: ValueError", rank=rank0, decision="restart"),
            rec("last_progress", t + 9.1, cycle, node, before="stop", ranks=ranks),
            rec("stop_done", t + 9.5, cycle, node, duration=0.4),
            rec("restart", t + 9.6, cycle, node),
        ]  # fmt: skip
    return found


# --- NodeView ---------------------------------------------------------------------------------


def test_the_view_follows_the_states_and_counts_restarts_by_their_cause():
    view = NodeView("n0")
    for record in cycle_records("n0", 0, 100.0, 0, "exception"):
        view.apply(record)
    assert (view.state, view.since, view.restarts) == (
        NodeState.RESTARTING,
        109.5,
        {"exception": 1},
    )
    for record in cycle_records("n0", 1, 110.0, 0, None):
        view.apply(record)
    assert (view.state, view.cycle, view.group_rank, view.stepping) == (
        NodeState.STEPPING, 1, 0, (0, 1))  # fmt: skip
    view.apply(rec("last_progress", 130.0, 1, before="stop", ranks=[0, 1]))
    view.apply(rec("restart", 131.0, 1))  # stopped for another node's failure
    view.apply(rec("failure", 140.0, 2, kind="peer lost", detail="gloo", key="k", secondary=True))
    view.apply(rec("restart", 141.0, 2))
    assert view.restarts == {"exception": 1, ELSEWHERE: 1, "peer lost": 1}
    assert view.failures == {"exception": 1}  # a consequence is not this node's failure
    view.apply(rec("exit", 150.0, 2, code=0))
    assert (view.state, view.exit_code) == (NodeState.EXITED, 0)


def test_the_view_keeps_a_bounded_failure_list_and_the_newest_checkpoint_of_each_tier():
    view = NodeView("n0")
    for i in range(20):
        view.apply(rec("failure", float(i), i, kind="hang", detail="heartbeat", key="hang"))
    assert len(view.last_failures) == LAST_FAILURES and view.failures == {"hang": 20}
    view.apply(rec("ckpt_held", 1.0, session="s", iteration=20, world_size=4))
    view.apply(rec("ckpt_held", 2.0, session="s", iteration=10, world_size=4))  # older: kept 20
    view.apply(rec("ckpt_replicated", 3.0, session="s", iteration=20, rank=0, to=["n1"],
                   bytes=1, seconds=0.5, lag=0.75))  # fmt: skip
    assert view.tiers["local"].iteration == 20
    assert (view.tiers["replicated"].iteration, view.tiers["replicated"].lag) == (20, 0.75)
    view.apply(rec("health_finding", 4.0, finding="Xid 79", fault=True, gpu=0))
    assert view.health == {("Xid 79", True): 1}


# --- metrics ----------------------------------------------------------------------------------


def snapshot(ranks: int, last: float, sections: dict[str, float] | None = None) -> list:
    timeouts = Timeouts(heartbeat=30.0, sections=sections or {"step": 10.0})
    return [ProgressSnapshot(r, 100 + r, 100 + r, 1.0, last - r, 0, 50 + r, timeouts)
            for r in range(ranks)]  # fmt: skip


def scrape(collector: NodeMetrics) -> dict[tuple[str, frozenset], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    [found] = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= lab]
    return found


def test_metrics_read_the_events_and_the_ranks_progress_at_scrape_time():
    metrics = NodeMetrics("job", "n0", lambda: snapshot(2, 40.0), clock=lambda: 42.0)
    for record in cycle_records("n0", 0, 100.0, 0, "exception"):
        metrics.apply(record)
    samples = scrape(metrics)
    base = {"job": "job", "node": "n0"}
    assert value(samples, "ftrun_restarts_total", cause="exception", **base) == 1
    assert value(samples, "ftrun_failures_total", kind="exception") == 1
    assert value(samples, "ftrun_node_state", state="restarting") == 1
    assert value(samples, "ftrun_node_state", state="stepping") == 0
    assert value(samples, "ftrun_rank_last_progress_age_seconds", rank="0") == 2.0
    assert value(samples, "ftrun_rank_last_progress_age_seconds", rank="1") == 3.0
    assert value(samples, "ftrun_rank_iteration", rank="1") == 51
    assert value(samples, "ftrun_heartbeat_timeout_seconds") == 30.0
    assert value(samples, "ftrun_section_timeout_seconds", section="step") == 10.0
    assert not [n for n, _ in samples if n.startswith("ftrun_job_")]  # only with the page
    metrics.apply(rec("ckpt_held", 110.0, session="s", iteration=40, world_size=4, stall=0.25))
    samples = scrape(metrics)
    assert value(samples, "ftrun_checkpoint_iteration", tier="local") == 40
    assert value(samples, "ftrun_checkpoint_save_stall_seconds") == 0.25


def test_metrics_stay_bounded_however_long_the_job_runs():
    metrics = NodeMetrics("job", "n0", lambda: snapshot(8, 40.0), clock=lambda: 42.0)

    def run(cycles: range) -> int:
        for cycle in cycles:
            for record in cycle_records("n0", cycle, 100.0 * cycle, 0, "hang"):
                metrics.apply(record)
            worst = [[r, f"n{r % 1024}", 0.5] for r in range(32)]
            metrics.apply(rec("straggler_report", 1.0, cycle, seq=cycle, ranks=8192, worst=worst))
        return len(scrape(metrics))

    first = run(range(3))
    assert run(range(3, 300)) == first
    assert first < 100  # 8 ranks: see the module docstring of ftrun.observe.metrics


def test_ranks_stepping_and_recoveries_by_tier_and_cause_are_served():
    metrics = NodeMetrics("job", "n0", list)
    for record in cycle_records("n0", 0, 100.0, 0, "hang"):
        metrics.apply(record)
    for record in cycle_records("n0", 1, 110.0, 0, None):
        metrics.apply(record)
    samples = scrape(metrics)
    assert (value(samples, "ftrun_ranks"), value(samples, "ftrun_ranks_stepping")) == (2, 2)
    metrics.apply(rec("failure", 121.0, 2, kind="hang", detail="d", key="k", decision="stop job"))
    samples = scrape(metrics)
    assert value(samples, "ftrun_ranks_stepping") == 0  # failing: none is stepping now
    assert value(samples, "ftrun_recoveries_total", tier="restart", cause="hang") == 1
    assert value(samples, "ftrun_recoveries_total", tier="stop job", cause="hang") == 1
    assert value(samples, "ftrun_rendezvous_duration_seconds_count") == 2
    assert value(samples, "ftrun_rendezvous_duration_seconds_bucket", le="0.5") == 2
    assert value(samples, "ftrun_recovery_duration_seconds_count") == 1  # cycle 1 stepped again
    assert value(samples, "ftrun_recovery_duration_seconds_sum") == 3.0  # the verdict 109 -> 112
    assert value(samples, "ftrun_recovery_duration_seconds_bucket", le="+Inf") == 1


def test_in_process_restarts_count_as_their_own_tier_with_their_seconds():
    timings = NodeTimings()
    timings.apply(rec("inprocess_recovered", 10.0, 0, iteration=0, kind="EXCEPTION", seconds=0.2))
    timings.apply(rec("rank_replaced", 20.0, 0, rank=1, pid=42, cause="killed"))
    timings.apply(rec("inprocess_recovered", 20.5, 0, iteration=1, kind="TERMINATED", seconds=0.4))
    assert timings.recoveries == {("in-process", "EXCEPTION"): 1, ("in-process", "TERMINATED"): 1}
    assert (sum(timings.recovery.counts), timings.recovery.cumulative()[0]) == (2, (0.5, 2))


def test_recovery_runs_from_the_last_progress_to_stepping_again_across_cycles_that_failed():
    timings = NodeTimings()
    timings.apply(rec("stepping", 10.0, 0, ranks=[0], progress_ts=10.0, progress_mono=10.0))
    timings.apply(rec("failure", 50.0, 0, kind="exception", detail="E", key="k"))  # no decision
    timings.apply(rec("last_progress", 50.1, 0, before="stop", ranks=[0], progress_mono=48.0))
    timings.apply(rec("restart", 51.0, 0))
    # cycle 1 never trains: a peer is lost while starting (a consequence, not this node's own)
    timings.apply(rec("failure", 60.0, 1, kind="peer lost", detail="d", key="k", secondary=True))
    timings.apply(rec("last_progress", 60.1, 1, before="stop", ranks=[0]))  # no progress
    timings.apply(rec("restart", 61.0, 1))
    timings.apply(rec("stepping", 80.0, 2, ranks=[0], progress_ts=80.0, progress_mono=80.0))
    assert timings.recoveries == {("restart", "exception"): 1}
    assert (sum(timings.recovery.counts), timings.recovery.total) == (1, 32.0)  # 48 -> 80
    assert timings.recovery.cumulative()[RECOVERY_BOUNDS.index(30.0)] == (30.0, 0)
    assert timings.recovery.cumulative()[RECOVERY_BOUNDS.index(60.0)] == (60.0, 1)
    timings.apply(rec("last_progress", 90.0, 2, before="finished", ranks=[0]))
    timings.apply(rec("exit", 91.0, 2, code=0))
    timings.apply(rec("stepping", 95.0, 3, ranks=[0], progress_ts=95.0, progress_mono=95.0))
    assert sum(timings.recovery.counts) == 1  # finishing is not a failure to recover from
    timings.apply(rec("restart", 100.0, 3))
    timings.apply(rec("exit", 101.0, 3, code=1))  # never stepped again: no recovery to count
    timings.apply(rec("stepping", 120.0, 4, ranks=[0], progress_ts=120.0, progress_mono=120.0))
    assert sum(timings.recovery.counts) == 1
    timings.apply(rec("rendezvous_done", 1.0, duration=400.0, nodes=[], group_rank=0))
    timings.apply(rec("rendezvous_done", 1.0, duration=True, nodes=[], group_rank=0))  # not one
    assert timings.rendezvous.cumulative()[-2:] == [(300.0, 0), (float("inf"), 1)]


def test_the_job_series_come_from_the_status_document():
    status = {"ettr": 0.5, "lost_s": 10.0, "wall_s": 20.0, "cycle": 2, "restarts": 2}
    samples = scrape(NodeMetrics("job", "n0", list, lambda: status))
    assert value(samples, "ftrun_job_ettr_ratio", job="job") == 0.5
    assert value(samples, "ftrun_job_lost_seconds") == 10.0


# --- the store feed ---------------------------------------------------------------------------


def test_the_feed_copies_events_and_the_reader_fetches_only_what_is_new():
    store = HashStore()
    writers = {node: FeedWriter(store, "ftrun/j", node) for node in NODES}
    for writer in writers.values():
        writer.register()
    writers["n0"].events(cycle_records("n0", 0, 100.0, 0, None))
    writers["n0"].events([rec("rank_startup", 101.0, rank=0, pid=1, path="forked")])  # local only
    reader = FeedReader(store, "ftrun/j")
    events, live = reader.read()
    assert [len(events[n]) for n in NODES] == [4, 0]
    assert live["n1"] == {"ts": 0, "cycle": 0, "progress": []}
    writers["n1"].events(cycle_records("n1", 0, 100.0, 2, "exception"))
    writers["n1"].live({"ts": 5.0, "cycle": 0, "progress": [[2, 7, 0.5]]})
    events, live = reader.read()
    assert [len(events[n]) for n in NODES] == [4, 8]
    assert live["n1"]["progress"] == [[2, 7, 0.5]]
    again = FeedWriter(store, "ftrun/j", "n0")  # a relaunched launcher continues the stream
    again.register()
    again.events([rec("exit", 200.0, 0, code=0)])
    events, _ = reader.read()
    assert events["n0"][-1].event == "exit" and len(events["n0"]) == 5
    assert reader.nodes() == list(NODES)


def test_the_reader_asks_for_many_keys_in_bounded_requests(monkeypatch: pytest.MonkeyPatch):
    asked: list[int] = []

    class Counting(HashStore):
        def multi_get(self, keys: list[str]) -> list[bytes]:
            asked.append(len(keys))
            return super().multi_get(keys)

    store = Counting()
    monkeypatch.setattr(feed, "BATCH", 3)
    writer = FeedWriter(store, "p", "n0")
    writer.register()
    writer.events([rec("restart", float(i), i) for i in range(10)])
    assert len(FeedReader(store, "p").read()[0]["n0"]) == 10
    assert max(asked) == 3


def test_a_line_that_is_not_an_event_is_skipped_and_counted():
    store = HashStore()
    writer = FeedWriter(store, "p", "n0")
    writer.register()
    store.set("p/observe/events/n0/1", b"not json")
    store.set("p/observe/events/n0/n", b"1")
    reader = FeedReader(store, "p")
    assert reader.read()[0]["n0"] == [] and reader.skipped == 1
    writer.events([rec("exit", 1.0, code=0)])  # the writer's own count goes on from 0: it
    assert len(reader.read()[0]["n0"]) == 0  # wrote key 1 again, which the reader has read


# --- the job status ---------------------------------------------------------------------------


def events_of(records: list[dict]) -> dict[str, list]:
    found: dict[str, list] = {}
    for record in records:
        event = parse_line(json.dumps(record))
        assert event is not None, record
        found.setdefault(event.node, []).append(event)
    return found


def two_node_job() -> list[dict]:
    records = cycle_records("n0", 0, 100.0, 0, "exception") + cycle_records("n1", 0, 100.0, 2, None)
    records += [rec("restart", 109.6, 0, "n1")]
    records += cycle_records("n0", 1, 110.0, 0, None) + cycle_records("n1", 1, 110.0, 2, None)
    return records


def test_the_status_tells_each_node_the_cycle_the_failures_and_the_time_lost():
    live = {"n0": {"ts": 119.0, "cycle": 1, "progress": [[0, 70, 0.2], [1, 71, 0.3]]}}
    doc = job_status("job", events_of(two_node_job()), live, now=120.0)
    assert (doc["outcome"], doc["cycle"], doc["restarts"]) == ("RUNNING", 1, 1)
    assert doc["inprocess_restarts"] == 0
    recovered = rec("inprocess_recovered", 119.5, 1, "n0", iteration=0, kind="EXCEPTION",
                    from_rank=1, seconds=0.2)  # fmt: skip
    assert job_status("job", events_of([*two_node_job(), recovered]), live,
                      now=120.0)["inprocess_restarts"] == 1  # fmt: skip
    assert [(n["node"], n["state"], n["stepping"]) for n in doc["nodes"]] == [
        ("n0", "stepping", [0, 1]), ("n1", "stepping", [2, 3])]  # fmt: skip
    assert doc["nodes"][0]["progress"] == [[0, 70, 1.2], [1, 71, 1.3]]  # aged since published
    assert doc["nodes"][0]["last_failure"]["kind"] == "exception"
    assert [f["signature"] for f in doc["failures"]] == ["exception: ValueError"]
    assert doc["wall_s"] == pytest.approx(20.1)  # from the first health check's start
    assert 0 < doc["effective_s"] < doc["wall_s"]
    later = job_status("job", events_of(two_node_job()), live, now=130.0)
    assert later["effective_s"] == doc["effective_s"] + 10  # still stepping: training so far
    text = status_table(doc)
    assert "cycle 1" in text and "n1" in text and "exception: ValueError on n0 rank 0" in text


def test_a_lost_node_and_a_silent_one_are_shown_as_such():
    live = {n: {"ts": 100.0, "cycle": 1, "progress": [[0, 7, 0.1]]} for n in NODES}
    doc = job_status("job", events_of(two_node_job()), live, now=126.0)
    assert [(n["state"], n["silent"]) for n in doc["nodes"]] == [("stepping", True)] * 2
    records = [
        *two_node_job(),
        rec("health_check", 124.0, 1, "n0", duration=0.1),
        rec("node_lost", 125.0, 2, "n0", nodes=["n1"], lost_cycle=1),
    ]
    doc = job_status("job", events_of(records), live, now=126.0)
    assert [(n["state"], n["silent"]) for n in doc["nodes"]] == [
        ("joining", False), ("lost", False)]  # fmt: skip


def test_a_finished_job_keeps_its_figures():
    records = [*two_node_job(), *(rec("exit", 121.0, 1, n, code=0) for n in NODES)]
    first = job_status("job", events_of(records), {}, now=200.0)
    assert first["outcome"] == "SUCCESS" and first["wall_s"] == pytest.approx(21.1)
    assert job_status("job", events_of(records), {}, now=900.0) == {**first, "now": 900.0}


def test_checkpoint_tiers_are_complete_when_every_node_holds_them():
    records = [
        *two_node_job(),
        rec("ckpt_held", 115.0, 1, "n0", session="s", iteration=30, world_size=4, stall=0.02),
        rec("ckpt_held", 115.5, 1, "n1", session="s", iteration=20, world_size=4),
        rec("ckpt_replicated", 116.0, 1, "n0", session="s", iteration=30, rank=0, to=["n1"],
            bytes=1, seconds=0.1, lag=0.4),
    ]  # fmt: skip
    tiers = job_status("job", events_of(records), {}, now=120.0)["checkpoints"]
    assert tiers == {
        "local": {"iteration": 20, "newest": 30, "lag_s": None, "stall_s": 0.02},
        "replicated": {"iteration": None, "newest": 30, "lag_s": 0.4, "stall_s": None},
    }


# --- the page ---------------------------------------------------------------------------------


@pytest.fixture
def page() -> Iterator[str]:
    calls: list[int] = []

    def build() -> dict:
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionError("store gone")
        return {"job": "j", "waiting": True, "calls": len(calls)}

    server = serve(CachedStatus(build, 0.0, lambda: 0.0), "127.0.0.1", 0)  # built every time
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def http(url: str, method: str = "GET") -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as got:
            return got.status, got.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_page_serves_the_html_and_the_json_and_nothing_else(page: str):
    code, body = http(page + "/")
    assert code == 200 and b'fetch("status.json"' in body and b"innerHTML" not in body
    assert http(page + "/status.json") == (200, b'{"job": "j", "waiting": true, "calls": 1}')
    assert http(page + "/status.json")[0] == 503  # the build failed: said, and still serving
    assert http(page + "/")[0] == 200
    assert http(page + "/admin")[0] == 404
    assert http(page + "/favicon.ico") == (204, b"")
    for method in ("POST", "PUT", "DELETE"):
        assert http(page + "/status.json", method)[0] == 501  # read-only


def test_the_status_is_rebuilt_at_most_once_per_refresh():
    builds: list[float] = []
    now = [0.0]

    def build() -> dict:
        builds.append(now[0])
        return {}

    cached = CachedStatus(build, 1.0, lambda: now[0])
    assert cached.last() is None
    for t in (0.0, 0.5, 0.99, 1.0, 1.5, 2.2):
        now[0] = t
        cached.get()
    assert builds == [0.0, 1.0, 2.2]


def test_a_slow_status_is_rebuilt_less_often():
    now = [0.0]
    builds: list[float] = []

    def build() -> dict:  # takes 0.5 s: kept for 4 x 0.5 s
        builds.append(now[0])
        now[0] += 0.5
        return {}

    cached = CachedStatus(build, 1.0, lambda: now[0])
    for t in (0.0, 1.6, 2.4, 2.6, 5.0):
        now[0] = max(now[0], t)
        cached.get()
    assert builds == [0.0, 2.4, 5.0]


# --- ftrun status -----------------------------------------------------------------------------


def test_ftrun_status_reads_a_log_dir(tmp_path: Path):
    for node in NODES:
        lines = [json.dumps(r) for r in two_node_job() if r["node"] == node]
        (tmp_path / f"events-{node}.jsonl").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(ftrun_main, ["status", "--log-dir", str(tmp_path)])
    assert result.exit_code == 0 and "n0" in result.output and "restarts 1" in result.output
    result = CliRunner().invoke(ftrun_main, ["status", "--log-dir", str(tmp_path), "--json"])
    assert json.loads(result.output)["cycle"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give one of --log-dir DIR or --endpoint HOST:PORT"),
        (["--log-dir", "x", "--endpoint", "h:1"], "give one of"),
        (["--log-dir", "/nonexistent/dir"], "no such directory: /nonexistent/dir"),
        (["--endpoint", "127.0.0.1:1"], "cannot read http://127.0.0.1:1/status.json"),
        (["--endpoint", "127.0.0.1:1", "--watch", "0"], "--watch: SECONDS must be positive"),
    ],
)
def test_ftrun_status_errors_are_one_line(args: list[str], message: str):
    result = CliRunner().invoke(ftrun_main, ["status", *args])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("ftrun status: error: ") and message in result.output


def test_the_feed_thread_keeps_events_through_a_store_error_and_publishes_them_later():
    failures = [2]  # the first two sets of an event key fail: the store host is unreachable

    class Flaky(HashStore):
        def set(self, key: str, value: bytes) -> None:
            if "/events/n0/" in key and not key.endswith("/n") and failures[0] > 0:
                failures[0] -= 1
                raise ConnectionError("store unreachable")
            super().set(key, value)

    store = Flaky()
    snapshot = [ProgressSnapshot(0, 1, 1, 1.0, time.monotonic(), 0, 7)]
    thread = FeedThread(FeedWriter(store, "p", "n0"), lambda: snapshot, 0.1)
    thread.start()
    try:
        for i in range(3):
            thread.queue.put(rec("restart", float(i), 1))
        reader = FeedReader(store, "p")
        wait_for(lambda: len(reader.read()[0].get("n0", [])) == 3, 10, "the three events")
        live = wait_for(lambda: (r := reader.read()[1]["n0"]) and r["progress"] and r, 10, "live")
        assert live["cycle"] == 1 and live["progress"][0][:2] == [0, 7]
    finally:
        thread.stop()
    assert failures == [0]


def test_each_gpu_the_health_watch_reads_is_served_with_its_index(fake_nvml, tmp_path):
    from ftrun.agent.node_services.health_watch import HealthWatch
    from ftrun.config.agent import HealthCheckConfig

    xids = tmp_path / "xids"
    spec = {"devices": 4, "xid_file": str(xids), "memory": {"2": [3 << 30, 80 << 30]},
            "utilization": {"2": 87, "3": 0}, "throttle": {"3": 0x40}}  # fmt: skip
    fake_nvml.setenv("FAKE_NVML", json.dumps(spec))
    watch = HealthWatch(HealthCheckConfig(watch_interval=1, gpus="2,3"), lambda *a, **k: None,
                        lambda _: None)  # fmt: skip
    metrics = NodeMetrics("job", "n0", list, gpus=watch.gpus)
    assert not [n for n, _ in scrape(metrics) if n.startswith("ftrun_gpu_")]  # no poll yet
    watch.begin_cycle()
    xids.write_text("3 79\n0 79\n")  # GPU 0 is another launcher's
    watch.poll()
    samples = scrape(metrics)
    watch.close()
    assert value(samples, "ftrun_gpu_memory_used_bytes", gpu="2") == 3 << 30
    assert value(samples, "ftrun_gpu_memory_total_bytes", gpu="2") == 80 << 30
    assert value(samples, "ftrun_gpu_utilization_ratio", gpu="2") == 0.87
    assert value(samples, "ftrun_gpu_utilization_ratio", gpu="3") == 0.0
    assert value(samples, "ftrun_gpu_xid_events_total", gpu="3") == 1
    assert value(samples, "ftrun_gpu_throttled", gpu="3", reason="hardware thermal slowdown") == 1
    assert {dict(labels)["gpu"] for n, labels in samples if n.startswith("ftrun_gpu_")} == {
        "2", "3"}  # fmt: skip


def test_a_client_gone_mid_answer_or_sending_garbage_is_one_line_not_a_traceback(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
):
    """socketserver would print a traceback for each: a port scanner, a closed browser tab, a
    scrape that timed out. Both servers log one line and answer the next request."""
    import socket

    from ftrun.observe.http_servers import PageServer, serve_metrics

    registry = CollectorRegistry(auto_describe=False)
    page = serve(CachedStatus(lambda: {"ok": True}), "127.0.0.1", 0)
    metrics = serve_metrics(registry, "127.0.0.1", 0)
    try:
        for server in (page, metrics):
            port = server.server_address[1]
            for junk in (b"", b"\x00\xff" * 300 + b"\r\n\r\n", b"GET /" + b"a" * 70000):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    sock.sendall(junk)
            path = "/status.json" if server is page else "/metrics"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
                assert answer.status == 200
        with caplog.at_level("DEBUG", logger="ftrun.agent"):
            try:
                raise BrokenPipeError(32, "Broken pipe")
            except BrokenPipeError:
                PageServer.handle_error(page, None, ("127.0.0.1", 1234))
        assert [r.levelname for r in caplog.records] == ["DEBUG"]
        assert "Traceback" not in capfd.readouterr().err
    finally:
        for server in (page, metrics):
            server.shutdown()
            server.server_close()
