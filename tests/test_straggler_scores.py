"""Straggler scoring, pure: summaries, relative and individual scores, the report and the
decisions, on synthetic durations (no processes, no clock)."""

from __future__ import annotations

import json
import random

import pytest

from ftrun.config.straggler import ControlFile, StragglerAction, StragglerConfig, write_control
from ftrun.errors import ConfigError
from ftrun.rank_monitor.timings import SectionTimes, TimingBatch
from ftrun.straggler import Report, StragglerId
from ftrun.straggler.assemble import assemble, assemble_columns, columns, decode_node, encode_node
from ftrun.straggler.collector import Leader, NodeCollector
from ftrun.straggler.decide import decide, findings
from ftrun.straggler.report import format_scores, report_text
from ftrun.straggler.scores import History, summarise, weighted

MS = 1_000_000


def batch(rank: int, ms: list[float], section: str = "step", gpu: bool = False) -> TimingBatch:
    return TimingBatch(
        rank, 100 + rank, (SectionTimes(section, gpu, tuple(int(v * MS) for v in ms)),), 0.0
    )


def run_intervals(speeds, intervals: int, seed: int = 0, noise: float = 0.03, gpu: bool = False):
    """Reports of `intervals` intervals of 4 ranks on 2 nodes; speeds(rank, interval) -> ms."""
    rng = random.Random(seed)
    nodes = {"a": NodeCollector("a"), "b": NodeCollector("b")}
    leader, reports = Leader(), []
    for interval in range(intervals):
        records = {}
        for name, collector in nodes.items():
            for rank in (0, 1) if name == "a" else (2, 3):
                base = speeds(rank, interval)
                collector.add(
                    batch(
                        rank, [base * rng.uniform(1 - noise, 1 + noise) for _ in range(25)], gpu=gpu
                    )
                )
            ranks = collector.close_interval()
            records[name] = decode_node(encode_node(collector.seq, name, ranks))
        reports.append(assemble_columns(leader.fresh(records), leader.seq))
    return reports


def test_summaries_and_relative_scores():
    assert summarise([3, 1, 2]) == (2.0, 3, 6.0)
    assert summarise([4, 1, 3, 2]).median == 2.5
    report = assemble({r: rec for r, rec in records_of({0: 10.0, 1: 14.0}).items()})
    assert report.section_relative_perf_scores == {"step": {0: 1.0, 1: pytest.approx(1 / 1.4)}}
    assert weighted({"a": 0.5, "b": 1.0}, {"a": 3.0, "b": 1.0}) == pytest.approx(0.625)


def test_a_rank_slowed_by_40_percent_is_named_with_its_node_in_the_first_report():
    reports = run_intervals(lambda rank, _: 14.0 if rank == 3 else 10.0, 2)
    for report in reports:
        found = findings(report, StragglerConfig())
        assert {(f.rank, f.node, f.kind) for f in found} == {(3, "b", "section_relative")}
        assert report.identify_stragglers()["straggler_sections_relative"] == {
            "step": {StragglerId(3, "b")}
        }


def test_a_balanced_run_is_never_flagged_over_ten_intervals():
    for seed in range(20):
        for report in run_intervals(lambda rank, _: 10.0, 10, seed=seed, noise=0.08):
            assert findings(report, StragglerConfig()) == []


def test_a_rank_that_slows_mid_run_is_caught_by_its_individual_score():
    # Every rank slows alike at interval 6 (a relative score cannot see it), rank 1 a lot more.
    def speed(rank: int, interval: int) -> float:
        return 10.0 if interval < 6 else (16.0 if rank == 1 else 10.5)

    reports = run_intervals(speed, 8, gpu=True)
    assert all(not findings(r, StragglerConfig()) for r in reports[:6])
    caught = findings(reports[6], StragglerConfig())
    assert {(f.rank, f.kind) for f in caught} == {(1, "gpu_individual"), (1, "gpu_relative")}
    assert reports[6].gpu_individual_perf_scores[1] == pytest.approx(10 / 16, rel=0.05)


def test_one_lucky_interval_does_not_skew_later_individual_scores():
    history = History(length=8)
    for median in [10.0, 10.0, 10.0, 5.0, 10.0, 10.0]:  # best-ever would be 5: scores of 0.5
        score = history.score(0, "step", False, median)
    assert score == pytest.approx(1.0)


def test_the_individual_reference_adapts_to_a_lasting_change():
    history = History(length=8)
    scores = [history.score(0, "step", False, m) for m in [10.0] * 4 + [14.0] * 10]
    assert scores[0] is None and scores[1:4] == [1.0] * 3  # a score from the 2nd interval
    assert scores[4] == pytest.approx(10 / 14)  # caught when it slows ...
    assert scores[-1] == pytest.approx(1.0)  # ... and the new speed is the reference later


def test_stale_node_records_are_not_reported_again():
    leader = Leader()
    rec = columns("a", {0: assemble_record()})
    assert leader.fresh({"a": (1, rec)}) == [rec] and leader.seq == 1
    assert leader.fresh({"a": (1, rec)}) is None
    assert leader.fresh({"a": (2, rec)}) == [rec] and leader.seq == 2


def test_the_first_report_waits_a_little_for_every_node():
    leader, rec = Leader(patience=2), columns("a", {0: assemble_record()})
    other = columns("b", {1: assemble_record()})
    assert leader.fresh({"a": (1, rec)}, ["a", "b"]) is None
    assert leader.fresh({"a": (2, rec), "b": (1, other)}, ["a", "b"]) == [rec, other]
    late = Leader(patience=2)
    assert late.fresh({"a": (1, rec)}, ["a", "b"]) is None
    assert late.fresh({"a": (2, rec)}, ["a", "b"]) is None
    assert late.fresh({"a": (3, rec)}, ["a", "b"]) == [rec]  # b's workers time nothing


def records_of(ms_by_rank: dict[int, float]):
    collector = NodeCollector("a")
    for rank, ms in ms_by_rank.items():
        collector.add(batch(rank, [ms]))
    return collector.close_interval()


def assemble_record():
    collector = NodeCollector("a")
    collector.add(batch(0, [10.0]))
    return collector.close_interval()[0]


@pytest.mark.parametrize(
    ("action", "nodes", "min_nodes", "standby", "done", "expected"),
    [
        (StragglerAction.LOG, 2, 1, 0, False, ("log", None)),
        (StragglerAction.STOP, 2, 2, 0, False, ("stop", None)),
        (StragglerAction.EXCLUDE, 2, 1, 0, False, ("exclude", "b")),
        (StragglerAction.EXCLUDE, 2, 2, 1, False, ("exclude", "b")),
        (StragglerAction.EXCLUDE, 2, 2, 0, False, ("log", None)),
        (StragglerAction.EXCLUDE, 2, 1, 0, True, ("log", None)),
    ],
)
def test_what_a_straggler_causes(action, nodes, min_nodes, standby, done, expected):
    report = run_intervals(lambda rank, _: 14.0 if rank == 3 else 10.0, 1)[0]
    config = StragglerConfig(action=action)
    names = ["a", "b"][:nodes]
    decision = decide(report, config, names, min_nodes, standby, done)
    assert (decision.action, decision.exclude) == expected
    assert decision.findings[0].rank == 3
    if expected[0] == "log" and action is StragglerAction.EXCLUDE:
        assert decision.note
    balanced = run_intervals(lambda rank, _: 10.0, 1)[0]
    assert decide(balanced, config, names, min_nodes, standby, done).action == "none"


def test_the_report_text_is_nvrx_s():
    scores = {r: 1.0 - r / 100 for r in range(12)}
    nodes = {r: f"n{r // 4}" for r in range(12)}
    text = format_scores(scores, nodes, count=2)
    assert text == (
        " Worst performing 2/12 ranks:\n"
        "  Rank=11 Node=n2 Score=0.89\n  Rank=10 Node=n2 Score=0.90\n"
        " Best performing 2/12 ranks:\n"
        "  Rank=0 Node=n0 Score=1.00\n  Rank=1 Node=n0 Score=0.99\n"
    )
    report = run_intervals(lambda rank, _: 14.0 if rank == 3 else 10.0, 1, gpu=True)[0]
    text = report_text(report)
    assert text.startswith("GPU relative performance:\n  Rank=3 Node=b Score=0.71\n")


def test_the_report_survives_json_and_narrows_to_one_rank():
    report = run_intervals(lambda rank, _: 14.0 if rank == 3 else 10.0, 4)[3]
    back = Report.from_json(json.loads(json.dumps(report.to_json())))
    assert back.section_relative_perf_scores == report.section_relative_perf_scores
    assert back.rank_to_node == {0: "a", 1: "a", 2: "b", 3: "b"} and back.seq == 4
    mine = back.for_rank(3)
    assert mine.section_relative_perf_scores == {"step": {3: pytest.approx(1 / 1.4, rel=0.05)}}
    assert mine.rank == 3 and not mine.gather_on_rank0


def test_settings_change_at_runtime_through_the_control_file(tmp_path):
    base = StragglerConfig()
    control = ControlFile(tmp_path / "straggler.json")
    assert control.changed() is None
    write_control(tmp_path, {"action": "exclude", "report_interval": 5}, base)
    assert base.with_overrides(control.changed()).action is StragglerAction.EXCLUDE
    assert control.changed() is None  # unchanged since
    write_control(tmp_path, {"enabled": False}, base)
    changed = control.changed()
    assert changed == {"action": "exclude", "report_interval": 5, "enabled": False}
    (tmp_path / "straggler.json").unlink()
    assert control.changed() == {}
    for bad in ({"nope": 1}, {"action": "reboot"}, {"gpu_relative_threshold": 2}, {"enabled": 1}):
        with pytest.raises(ConfigError):
            write_control(tmp_path, bad, base)


def test_ftrun_report_pictures_scores_and_ftrun_straggler_retunes(tmp_path):
    from click.testing import CliRunner

    from ftrun.eventlog.writer import EventLog
    from ftrun.tools.cli import main

    events = EventLog(tmp_path, "n0")
    for seq in range(1, 5):
        worst = [[3, "n1", 0.7 if seq > 2 else 0.99], [0, "n0", 1.0]]
        events.emit("straggler_report", seq=seq, ranks=4, worst=worst, median=1.0)
    events.emit("straggler", seq=3, ranks=[3], nodes=["n1"], findings=[], action="log")
    events.close()
    out = CliRunner().invoke(main, ["report", str(tmp_path), "--no-timeline"]).output
    assert "  3 n1 |██░░| min 0.70\n  0 n0 |████| min 1.00\n  1 report(s) named stragglers" in out
    result = CliRunner().invoke(
        main, ["straggler", str(tmp_path), "--off", "--action", "exclude", "--threshold",
               "section_relative=0.6"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    overrides = ControlFile(tmp_path / "straggler.json").changed()
    config = StragglerConfig().with_overrides(overrides)
    assert (config.enabled, config.action, config.section_relative_threshold) == (
        False, StragglerAction.EXCLUDE, 0.6,
    )  # fmt: skip
    bad = CliRunner().invoke(main, ["straggler", str(tmp_path), "--threshold", "gpu=x"])
    assert bad.exit_code == 2
