"""The Grafana dashboard shipped with the package (`ftrun/observe/grafana/ftrun-job.json`): a
dashboard Grafana can import, and every query in it names series the agents serve.

The served names and labels come from `NodeMetrics` itself (every family populated from events
of every kind it reads), never from a list kept by hand: a metric renamed in
`ftrun.observe.metrics` fails here until the dashboard follows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ftrun.observe.metrics import NodeMetrics
from ftrun.rank_monitor.protocol import Timeouts
from ftrun.rank_monitor.records import ProgressSnapshot

DASHBOARD = "grafana/ftrun-job.json"
GRID_WIDTH = 24
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
"""The sample names prometheus_client exposes for a family of each type (OpenMetrics' `_created`
is not in the Prometheus text format the agents serve)."""


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


AGGREGATIONS = _words(
    "sum min max avg count stddev stdvar topk bottomk quantile count_values group"
)
FUNCTIONS = AGGREGATIONS | _words(
    "rate irate increase delta idelta deriv changes resets histogram_quantile round abs ceil "
    "floor clamp clamp_min clamp_max time timestamp vector scalar absent absent_over_time "
    "avg_over_time min_over_time max_over_time sum_over_time count_over_time last_over_time "
    "quantile_over_time label_replace label_join sort sort_desc predict_linear"
)
"""PromQL's functions that may appear in a panel (a query using another one fails here: add it
if PromQL has it)."""
KEYWORDS = _words("by without on ignoring group_left group_right bool and or unless offset inf nan")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
BUILTIN_VARIABLES = frozenset({"__range", "__rate_interval", "__interval"})


def load() -> dict[str, Any]:
    return json.loads(resources.files("ftrun.observe").joinpath(DASHBOARD).read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())  # a collapsed row keeps its panels inside


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", ()):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
            assert found, variable["definition"]
            yield f"variable {variable['name']}", f"group by ({found[2]}) ({found[1]})"


# --- what the agents serve --------------------------------------------------------------------


def rec(event: str, cycle: int = 0, mono: float = 100.0, **fields: Any) -> dict[str, Any]:
    return {"event": event, "ts": mono, "mono": mono, "node": "n0", "cycle": cycle, **fields}


def every_kind_of_record() -> list[dict[str, Any]]:
    """Events that give every family of `NodeMetrics` at least one sample."""
    copied = {"to": ["n1"], "bytes": 1, "seconds": 0.1, "lag": 0.2}
    return [
        rec("health_check", duration=0.1),
        rec("rendezvous_done", duration=0.4, nodes=["n0"], group_rank=0),
        rec("workers_started", ranks=[0, 1], pids=[1, 2]),
        rec("stepping", ranks=[0, 1], progress_ts=101.0, progress_mono=101.0),
        rec("health_finding", finding="Xid 79", fault=True, gpu=0),
        rec("straggler_report", seq=1, ranks=2, worst=[[1, "n0", 0.4]]),
        rec("ckpt_held", session="s", iteration=10, world_size=2, stall=0.1),
        rec("ckpt_replicated", session="s", iteration=10, rank=0, **copied),
        rec("failure", mono=110.0, kind="hang", detail="heartbeat", key="hang", decision="restart"),
        rec("last_progress", mono=110.1, before="stop", ranks=[0, 1], progress_mono=109.0),
        rec("restart", mono=111.0),
        rec("rendezvous_done", 1, 112.0, duration=0.5, nodes=["n0"], group_rank=0),
        rec("stepping", 1, 115.0, ranks=[0, 1], progress_ts=115.0, progress_mono=115.0),
    ]


def served() -> tuple[set[str], set[str]]:
    """The sample names and the label names the agents' registry exposes."""
    timeouts = Timeouts(heartbeat=30.0, sections={"step": 10.0})
    progress = [ProgressSnapshot(0, 1, 1, 1.0, 40.0, 0, 5, timeouts)]
    status = {"ettr": 0.5, "lost_s": 10.0, "wall_s": 20.0, "cycle": 1, "restarts": 1}
    metrics = NodeMetrics("job", "n0", lambda: progress, lambda: status, clock=lambda: 42.0)
    for record in every_kind_of_record():
        metrics.apply(record)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    names: set[str] = set()
    labels: set[str] = set()
    for family in registry.collect():
        assert family.samples, f"{family.name}: no sample (every_kind_of_record misses a kind)"
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
        names |= {sample.name for sample in family.samples}
        labels |= {label for sample in family.samples for label in sample.labels}
    return names, labels


# --- reading PromQL ---------------------------------------------------------------------------


def identifiers(expr: str) -> tuple[list[str], list[str], list[str]]:
    """(metric names, function names, label names) of a PromQL expression: well enough for the
    queries a dashboard holds (strings, matchers, ranges and grouping clauses are set apart
    first; an identifier followed by `(` is a function)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    labels = [
        name for inside in re.findall(r"\{([^{}]*)\}", text)
        for name in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", inside)
    ]  # fmt: skip
    labels += [name.strip() for inside in GROUPING.findall(text) for name in inside.split(",")]
    text = GROUPING.sub(" ", re.sub(r"\{[^{}]*\}|\[[^\[\]]*\]", " ", text))
    metrics, functions = [], []
    for found in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        word = found.group()
        if text[found.end() :].lstrip().startswith("("):
            functions.append(word)
        elif word.lower() not in KEYWORDS:
            metrics.append(word)
    return metrics, functions, [name for name in labels if name]


def balanced(expr: str) -> bool:
    depth = {"(": 0, "[": 0, "{": 0}
    closing = {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if char in depth:
            depth[char] += 1
        elif char in closing:
            depth[closing[char]] -= 1
            if depth[closing[char]] < 0:
                return False
    return not any(depth.values())


def test_identifiers_are_told_apart():
    expr = (
        'histogram_quantile(0.95, sum by (le) (increase(a_bucket{job="$job", x=~"b(c)"}[1h])))'
        " / on (job) group_left (node) max without (rank) (b_total offset 5m) > bool 1e3"
    )
    assert identifiers(expr) == (
        ["a_bucket", "b_total"],
        ["histogram_quantile", "sum", "increase", "max"],
        ["job", "x", "le", "job", "node", "rank"],
    )
    assert balanced(expr) and not balanced("sum(rate(x[5m])") and not balanced("x{a=1}}")


# --- the dashboard ----------------------------------------------------------------------------


def test_the_dashboard_is_one_grafana_can_import():
    dashboard = load()
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource", "prometheus")  # fmt: skip
    assert variables["job"]["type"] == "query" and not variables["job"]["multi"]
    assert variables["node"]["includeAll"] and variables["node"]["multi"]
    every = list(panels(dashboard))
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    charts = [p for p in every if p["type"] != "row"]
    assert len(charts) >= 10
    for panel in charts:
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for item in (panel, *panel["targets"]):
            assert item["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert_no_overlap(every)


def assert_no_overlap(every: list[dict[str, Any]]) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in every:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


def test_every_query_names_series_and_labels_the_agents_serve():
    names, labels = served()
    variables = {v["name"] for v in load()["templating"]["list"]} | BUILTIN_VARIABLES
    used: set[str] = set()
    for where, expr in queries(load()):
        metrics, functions, label_names = identifiers(expr)
        assert balanced(expr), f"{where}: unbalanced brackets in {expr}"
        assert metrics, f"{where}: names no metric: {expr}"
        assert set(metrics) <= names, f"{where}: not served: {set(metrics) - names}"
        assert set(functions) <= FUNCTIONS, f"{where}: not PromQL: {set(functions) - FUNCTIONS}"
        assert set(label_names) <= labels, f"{where}: no such label: {set(label_names) - labels}"
        assert set(re.findall(r"\$\{?(\w+)", expr)) <= variables, f"{where}: unknown variable"
        used |= set(metrics)
    issue_37 = {  # what the operators asked to see
        "ftrun_cycle", "ftrun_recoveries_total", "ftrun_job_lost_seconds", "ftrun_ranks_stepping",
        "ftrun_rank_last_progress_age_seconds", "ftrun_health_findings_total",
        "ftrun_straggler_score", "ftrun_rendezvous_duration_seconds_bucket",
    }  # fmt: skip
    assert issue_37 <= used


@pytest.mark.parametrize("name", ["ftrun_no_such_metric", "ftrun_cycle_total"])
def test_a_name_the_agents_do_not_serve_is_caught(name: str):
    names, _ = served()
    metrics, _, _ = identifiers(f'max by (node) ({name}{{job="$job"}})')
    assert metrics == [name] and name not in names
