"""The alert rules that ship (src/ftrun/observe/prometheus/ftrun-alerts.yml), in a real
Prometheus's own tools: `promtool check rules`, and `promtool test rules` on
tests/prometheus/ftrun-alerts-test.yml; and the house rules every alert keeps (a `for:`, a
severity, a summary naming the job, a runbook section in docs/alerts.md, series the agents
export, a unit test, a panel of the Grafana dashboard)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "src" / "ftrun" / "observe" / "prometheus" / "ftrun-alerts.yml"
UNIT_TESTS = ROOT / "tests" / "prometheus" / "ftrun-alerts-test.yml"
DOCS = ROOT / "docs" / "alerts.md"
METRICS = ROOT / "src" / "ftrun" / "observe" / "metrics.py"
DASHBOARD = ROOT / "src" / "ftrun" / "observe" / "grafana" / "ftrun-job.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="no promtool (tests/prometheus/install-prometheus.sh installs it)"
)


def alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@needs_promtool
@pytest.mark.parametrize(
    "command", [["check", "rules", str(RULES)], ["test", "rules", UNIT_TESTS.name]]
)
def test_promtool_accepts_the_rules_and_their_unit_tests(command: list[str]) -> None:
    done = subprocess.run([PROMTOOL, *command], cwd=UNIT_TESTS.parent, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_unit_tested_and_documented() -> None:
    tested = {case["alertname"] for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
              for case in test["alert_rule_test"] if case.get("exp_alerts")}  # fmt: skip
    headings = set(re.findall(r"^## (Ftrun\w+)$", DOCS.read_text(), re.MULTILINE))
    panels = {panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"]}
    for rule in alerts():
        name = rule["alert"]
        assert name in tested, f"{name}: no unit test in which it fires"
        assert name in headings, f"{name}: no section in docs/alerts.md"
        assert "for" in rule and rule["labels"]["severity"] in ("page", "ticket"), name
        assert "{{ $labels.job }}" in rule["annotations"]["summary"], name
        assert rule["annotations"]["runbook_url"] == f"docs/alerts.md#{name.lower()}", name
        assert rule["annotations"]["dashboard_panel"] in panels, name


def test_every_series_a_rule_reads_is_one_the_agents_export() -> None:
    exported = set(re.findall(r'"(ftrun_[a-z_]+)"', METRICS.read_text()))
    for rule in alerts():
        for name in re.findall(r"\bftrun_[a-z_]+", rule["expr"]):
            assert name.removesuffix("_total") in exported, f"{rule['alert']}: {name}"
