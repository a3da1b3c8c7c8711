"""The live view with real launchers (2 nodes x 2 ranks): a crash, then a hang, read through the
Prometheus endpoints (parsed by prometheus_client's own parser), `/status.json` and
`ftrun status`.

The ranks are tests/workers/fault_worker.py (no torch): cycle 0's rank 1 raises, cycle 1's
rank 2 hangs inside its step; cycle 2 trains to the end.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import Job, free_port, start_job
from support import wait_for

pytestmark = pytest.mark.process

FAULT = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
HEARTBEAT_TIMEOUT_S = 3


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of the endpoint: (name, labels) -> value."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float | None:
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= lab]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def endpoints(job: Job) -> dict[str, str]:
    """node name -> its metrics URL, from each launcher's log line."""
    found = {}
    for node in job.nodes:
        match = re.search(r"\[ft_launcher (\S+)\].*metrics: (http://\S+)", node.text())
        if match:
            found[match.group(1)] = match.group(2)
    return found


def status(port: int) -> dict:
    return json.loads(
        urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5).read()
    )


def test_metrics_and_status_follow_a_crash_then_a_hang(tmp_path: Path):
    page = free_port()
    job = start_job(
        tmp_path, 2,
        ["--max-restarts=3", "--workers-stop-timeout=1", "--ft-prewarm-modules=ftrun.client_lib",
         f"--ft-rank-heartbeat-timeout={HEARTBEAT_TIMEOUT_S}", "--ft-metrics-port=0",
         f"--ft-status-port={page}"],
        ["--steps", "60", "--step-time", "0.05", "--raise", "0:1:20", "--hang", "1:2:20"],
        script=FAULT, nproc=2,
    )  # fmt: skip
    urls = wait_for(lambda: len(found := endpoints(job)) == 2 and found, 60, "two metrics URLs")
    first = job.wait_event("rendezvous_done", 2)[0]["nodes"]
    crashed, hung = first  # rank 1 is on group rank 0's node, rank 2 on group rank 1's
    job.wait_event("stepping", 4)  # both nodes stepping in cycle 1, after the crash

    def after_crash() -> dict | None:
        got = {node: scrape(url) for node, url in urls.items()}
        return got if all(sample(s, "ftrun_cycle") == 1 for s in got.values()) else None

    metrics = wait_for(after_crash, 30, "cycle 1 in both nodes' metrics")
    assert sample(metrics[crashed], "ftrun_restarts_total", cause="exception") == 1
    assert sample(metrics[crashed], "ftrun_failures_total", kind="exception") == 1
    assert sample(metrics[hung], "ftrun_restarts_total", cause="another node") == 1
    assert sample(metrics[hung], "ftrun_failures_total", kind="exception") is None
    assert sample(metrics[hung], "ftrun_heartbeat_timeout_seconds") == HEARTBEAT_TIMEOUT_S
    assert sample(metrics[crashed], "ftrun_node_state", state="stepping") == 1

    def hanging() -> dict | None:  # rank 2 stopped in its step; rank 3 (same node) goes on
        now = scrape(urls[hung])
        stuck = sample(now, "ftrun_rank_last_progress_age_seconds", rank="2")
        alive = sample(now, "ftrun_rank_last_progress_age_seconds", rank="3")
        ok = stuck is not None and alive is not None and stuck > 1.5 > alive
        return now if ok and sample(now, "ftrun_cycle") == 1 else None

    wait_for(hanging, 30, "rank 2's progress age growing while rank 3's stays small")
    job.wait_event("rendezvous_done", 6)  # cycle 2 formed on both nodes
    metrics = wait_for(
        lambda: (s := scrape(urls[hung])) and sample(s, "ftrun_cycle") == 2 and s, 30, "cycle 2"
    )
    assert sample(metrics, "ftrun_restarts_total", cause="hang") == 1
    assert sample(metrics, "ftrun_restarts_total", cause="another node") == 1
    assert sample(metrics, "ftrun_failures_total", kind="hang") == 1

    doc = wait_for(lambda: (d := status(page)) and d.get("cycle") == 2 and d, 30, "status cycle 2")
    assert doc["outcome"] == "RUNNING" and doc["restarts"] == 2
    assert [f["signature"].split(":")[0] for f in doc["failures"]] == ["hang", "exception"]
    assert [(f["node"], f["rank"]) for f in doc["failures"]] == [(hung, 2), (crashed, 1)]
    assert [n["node"] for n in doc["nodes"]] == first
    assert 0 < doc["ettr"] < 1 and doc["lost_s"] > 0
    table = subprocess.run(
        [sys.executable, "-m", "ftrun.tools.cli", "status", f"--endpoint=127.0.0.1:{page}"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    assert hung in table and "cycle 2" in table and "hang" in table

    assert job.wait(90) == [0, 0]
    after = subprocess.run(
        [sys.executable, "-m", "ftrun.tools.cli", "status", f"--log-dir={job.log_dir}"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    assert "SUCCESS" in after and "restarts 2" in after, after
