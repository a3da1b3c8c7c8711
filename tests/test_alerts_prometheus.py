"""The shipped alert rules in a real Prometheus scraping real agents (issue 55): 2 launchers x
1 rank (tests/workers/fault_worker.py, no torch), Prometheus scraping both every second.

Three failures in cycles 0, 1 and 2, each another (the same one three times would stop the
job, exit 6): three restarts within a second, and FtrunRestartStorm fires. In cycle 3 rank 0
hangs and ignores SIGTERM (a rank the launcher cannot stop, for the 45 s of
--workers-stop-timeout): its progress age passes the heartbeat timeout for 30 s and
FtrunRankProgressOverdue fires. Then it is SIGKILLed, cycle 4 trains, and both resolve.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from launch import free_port, start_job
from support import wait_for

pytestmark = [pytest.mark.process, pytest.mark.beside_slurm]  # 80 s, mostly waiting

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "src" / "ftrun" / "observe" / "prometheus" / "ftrun-alerts.yml"
FAULT = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = EVALUATION_S = 1


class Prometheus:
    """One Prometheus on 127.0.0.1 with the shipped rules, scraping `targets` every second."""

    def __init__(self, tmp: Path, targets: list[str]) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s",
                       "evaluation_interval": f"{EVALUATION_S}s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "ftrun", "honor_labels": True,
                                "static_configs": [{"targets": targets}]}],
        }  # fmt: skip
        (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def api(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        try:
            return json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]
        except OSError:
            return None

    def firing(self) -> dict[str, dict]:
        """alertname -> each firing alert (its labels, and `activeAt`: when it went pending)."""
        alerts = (self.api("alerts") or {}).get("alerts", [])
        return {a["labels"]["alertname"]: a for a in alerts if a["state"] == "firing"}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.mark.skipif(PROMETHEUS is None, reason="tests/prometheus/install-prometheus.sh")
def test_a_restart_storm_and_an_overdue_rank_fire_then_resolve(tmp_path: Path):
    job = start_job(
        tmp_path, 2,
        ["--max-restarts=5", "--workers-stop-timeout=45", "--ft-rank-heartbeat-timeout=2",
         "--ft-prewarm-modules=ftrun.client_lib", "--ft-metrics-port=0"],
        ["--start-after", "go", "--steps", "400", "--step-time", "0.05",
         "--raise", "0:0:5,2:1:5", "--exit", "1:0:5:3", "--stubborn", "3:0", "--hang", "3:0:10"],
        script=FAULT,
    )  # fmt: skip
    prometheus = None
    try:
        urls = wait_for(lambda: _metrics_targets(job.nodes), 60, "both agents' metrics URLs")
        prometheus = Prometheus(tmp_path, urls)
        wait_for(lambda: len((prometheus.api("query?query=ftrun_cycle") or {}).get("result", []))
                 == 2, 60, "Prometheus holding both agents' cycle")  # fmt: skip
        (job.ckpt_dir / "go").touch()
        storm = wait_for(lambda: prometheus.firing().get("FtrunRestartStorm"), 60, "the storm")
        labels = storm["labels"]
        assert labels["job"] == f"test-{tmp_path.name}" and labels["severity"] == "page", storm
        # Firing `for:` after it went pending, which is at most a scrape and an evaluation
        # (1 s each) after the third restart's cycle began (+ 1 s for this VM's load).
        third = min(e["ts"] for e in job.events("rendezvous_done") if e["cycle"] == 3)
        assert _epoch(storm["activeAt"]) - third <= SCRAPE_S + EVALUATION_S + 1, (storm, third)
        overdue = wait_for(lambda: prometheus.firing().get("FtrunRankProgressOverdue"), 90,
                           "the overdue rank")  # fmt: skip
        assert overdue["labels"]["rank"] == "0", overdue
        wait_for(lambda: not prometheus.firing(), 120, "every alert resolved", interval=0.5)
        assert job.wait(120) == [0, 0], job.nodes[0].text()[-3000:]
    finally:
        if prometheus is not None:
            prometheus.stop()
        job.kill()
    assert prometheus.proc.poll() is not None
    stubborn = [int(pid) for pid in (job.ckpt_dir / "stubborn-pids").read_text().split()]
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in stubborn), 10, "the stubborn rank")
    assert {e["cycle"] for e in job.events("rendezvous_done")} == {0, 1, 2, 3, 4}


def _epoch(rfc3339: str) -> float:
    """Prometheus's time (nanoseconds, `Z`) as epoch seconds."""
    whole, _, fraction = rfc3339.rstrip("Z").partition(".")
    moment = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC)
    return moment.timestamp() + float(f"0.{fraction or 0}")


def _metrics_targets(nodes: list) -> list[str] | None:
    found = [re.search(r"metrics: http://([^/\s]+)/", node.text()) for node in nodes]
    return [m.group(1) for m in found] if all(found) else None
