"""`ftrun report`: events parsing, the numbers of the summary, the timeline PNG, bad input.

The fixtures under tests/data/report are events files of real two-node runs:
- crash_hang: examples/train_ddp.py (crash in cycle 0, hang in cycle 1, success in cycle 2),
  the hang as intended (rank 2 sleeps; every rank misses its heartbeat),
- stale_hang: the same, but cycle 1 was failed at once by a verdict about cycle 0's (dead)
  workers. Neither reports training progress (they predate it): process times are reported.
- progress_crash: tests/workers/progress_worker.py (progress and iterations reported), a crash
  in cycle 0; `steps/` holds the ranks' own step logs of that run.
Synthetic files cover what a real run cannot cheaply produce (preemption, lost nodes).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import ftrun
from ftrun.agent.loop.reporting import CycleReport
from ftrun.agent.prewarm.marks import marks_path
from ftrun.eventlog import schema as events_schema
from ftrun.eventlog.failures import CRASH, HANG, RESTART, SIGNAL, ranks_text
from ftrun.eventlog.reader import Event, ReportInputError, load_events, parse_line
from ftrun.eventlog.report import Report, build_report
from ftrun.eventlog.schema import SCHEMA
from ftrun.eventlog.startup import startup_lines, startup_splits
from ftrun.eventlog.writer import EventLog
from ftrun.rank_monitor import FirstProgress, ProgressSnapshot
from ftrun.tools.cli import main
from launch import start_job
from support import WORKERS

DATA = Path(__file__).parent / "data" / "report"
CRASH_HANG = DATA / "crash_hang"
STALE_HANG = DATA / "stale_hang"
PROGRESS_CRASH = DATA / "progress_crash"  # tests/workers/progress_worker.py, a crash, iterations
NODE_A, NODE_B = "127.0.0.1-32172", "127.0.0.1-32171"  # group ranks 0 and 1 in crash_hang
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROGRESS_WORKER = WORKERS / "progress_worker.py"


def report_of(log_dir: Path) -> Report:
    return build_report(load_events(log_dir))


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["report", *args])


# ---- the real run: cycles, failures and their costs ------------------------------------------


def test_fixture_cycles_and_outcome() -> None:
    report = report_of(CRASH_HANG)
    assert report.outcome == "SUCCESS"
    assert {n.name: n.exit_code for n in report.nodes} == {NODE_A: 0, NODE_B: 0}
    assert [c.number for c in report.cycles] == [0, 1, 2]
    assert [c.outcome for c in report.cycles] == ["failed", "failed", "succeeded"]
    assert [c.failure for c in report.cycles] == [1, 2, None]
    assert all(c.nodes == (NODE_A, NODE_B) and c.world_size == 4 for c in report.cycles)
    assert report.cycles[0].rendezvous_s == pytest.approx(0.010324)
    assert report.cycles[0].stop_s == pytest.approx(0.145195)  # the slower node's stop
    assert report.cycles[2].stop_s is None and report.cycles[2].killed == 0
    assert report.wall_s == pytest.approx(1795385739.664539 - 1795385712.363316, abs=1e-5)


def test_fixture_crash_is_the_cause_with_its_costs() -> None:
    crash = report_of(CRASH_HANG).failures[0]
    assert (crash.kind, crash.cycle, crash.nodes, crash.ranks) == (CRASH, 0, (NODE_A,), (1,))
    assert crash.exit_code == 1 and crash.signal is None
    assert "rank 1 on 127.0.0.1-32172 crashed: exit code 1" in crash.cause
    assert crash.detection_s == 0.0
    # from the crash to the last workers_started of cycle 1, on either node
    assert crash.recovery_s == pytest.approx(1795385723.415697 - 1795385723.211799)
    assert crash.lost_s == pytest.approx(crash.recovery_s)


def test_fixture_hangs_of_one_cycle_are_one_failure() -> None:
    hang = report_of(CRASH_HANG).failures[1]
    assert (hang.kind, hang.cycle, hang.ranks) == (HANG, 1, (0, 1, 2, 3))
    assert set(hang.nodes) == {NODE_A, NODE_B}
    assert hang.hang is not None
    assert (hang.hang.kind, hang.hang.section, hang.hang.timeout) == ("heartbeat", None, 2.0)
    assert hang.hang.waited == pytest.approx(2.001069)
    assert hang.hang.detection_latency == pytest.approx(0.001069)
    assert len(hang.hang.stack_files) == 4
    assert hang.detection_s == pytest.approx(2.001069)
    assert hang.recovery_s == pytest.approx(1795385727.970397 - 1795385727.834305)
    # lost: from the last progress (verdict minus waited) to running again
    assert hang.lost_s == pytest.approx(hang.recovery_s + 2.001069)
    assert hang.secondary == () and hang.notes == ()


def test_fixture_effective_time_excludes_the_hang() -> None:
    report = report_of(CRASH_HANG)
    running = sum(c.end - c.running_at for c in report.cycles if c.running_at is not None)
    assert report.running_s == pytest.approx(running)
    assert report.effective_s == pytest.approx(running - 2.001069)
    assert report.effective_ratio == pytest.approx(report.effective_s / report.wall_s)
    assert 0.85 < report.effective_ratio < 0.95


def test_fixture_lanes_cover_every_state() -> None:
    spans = report_of(CRASH_HANG).spans
    for node in (NODE_A, NODE_B):
        states = [s.state for s in spans if s.node == node]
        assert states == ["rendezvous", "running", "stopping"] * 2 + [
            "rendezvous",
            "running",
            "finished",
        ]
    assert all(s.end >= s.start for s in spans)


def test_stale_verdict_is_flagged() -> None:
    report = report_of(STALE_HANG)
    hang = report.failures[1]
    assert hang.kind == HANG and hang.ranks == (0, 1)
    assert len(hang.notes) == 2 and all("stale verdict" in n for n in hang.notes)
    assert report.cycles[1].killed == 1  # one worker outlived the stop timeout
    # the verdict reaches back before cycle 1 started: time lost starts at the cycle's start
    assert hang.last_healthy == pytest.approx(report.cycles[1].running_at)


# ---- the command -----------------------------------------------------------------------------


def test_cli_prints_summary_and_writes_png(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    result = run_cli(str(CRASH_HANG), "--out", str(out))
    assert result.exit_code == 0, result.output
    text = result.stdout
    for expected in (
        "Outcome    SUCCESS",
        "3 cycle(s), 2 failure(s): 1 crash, 1 hang",
        "CRASH: rank 1 on 127.0.0.1-32172 crashed: exit code 1",
        "HANG: ranks 0-1 on 127.0.0.1-32172, 2-3 on 127.0.0.1-32171 hung: no heartbeat",
        "recovery 0.20s",
        "stacks: ",
        f"Timeline   {out}",
        # no RankMonitorClient progress in these files: said, and every time labelled
        "Training   no training progress reported (no RankMonitorClient): "
        "times below are process times",
        "(process time, an upper bound on training)",
        "Failures (2)  process times: recovery to every worker started again, not to training",
    ):
        assert expected in text
    assert result.stderr == ""
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000  # a drawing, not an empty canvas


def test_cli_json(tmp_path: Path) -> None:
    result = run_cli(str(CRASH_HANG), "--json", "--out", str(tmp_path / "t.png"))
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["schema"] == 4 and data["outcome"] == "SUCCESS"
    assert data["attributions"] == []  # events from before failures were named
    assert data["timeline"] == str(tmp_path / "t.png") and data["timeline_note"] is None
    assert data["progress_reported"] is False and data["startup_s"] is None
    assert [f["kind"] for f in data["failures"]] == [CRASH, HANG]
    assert data["failures"][1]["hang"]["waited"] == pytest.approx(2.001069)
    assert [c["outcome"] for c in data["cycles"]] == ["failed", "failed", "succeeded"]


def test_cli_no_timeline_skips_matplotlib(tmp_path: Path) -> None:
    log_dir = copy_fixture(tmp_path)
    result = run_cli(str(log_dir), "--no-timeline")
    assert result.exit_code == 0
    assert not (log_dir / "timeline.png").exists()
    assert "Timeline" not in result.stdout


def test_default_png_goes_to_the_log_dir(tmp_path: Path) -> None:
    log_dir = copy_fixture(tmp_path)
    assert run_cli(str(log_dir)).exit_code == 0
    assert (log_dir / "timeline.png").read_bytes().startswith(PNG_MAGIC)


# ---- bad input: one line, exit 2, no traceback -----------------------------------------------


@pytest.fixture
def bad_dirs(tmp_path: Path) -> Iterator[dict[str, Path]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "events-x.jsonl").write_text('not json\n{"event": "exit"}\n[1, 2]\n')
    a_file = tmp_path / "file.txt"
    a_file.write_text("hello")
    yield {"missing": tmp_path / "nope", "empty": empty, "garbage": garbage, "file": a_file}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such directory"),
        ("empty", "no events-*.jsonl files"),
        ("garbage", "no valid events"),
        ("file", "not a directory"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    bad_dirs: dict[str, Path], case: str, message: str
) -> None:
    result = run_cli(str(bad_dirs[case]))
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftrun report: error: ") and message in lines[0]


def test_bad_input_from_the_real_process(tmp_path: Path) -> None:
    """The exit status and stderr as a shell sees them: no traceback from any layer."""
    cmd = [sys.executable, "-c", "from ftrun.tools.cli import main; main()", "report"]
    proc = subprocess.run(
        [*cmd, str(tmp_path / "nope")], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_malformed_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    log_dir = copy_fixture(tmp_path)
    path = log_dir / f"events-{NODE_B}.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(3, '{"event": "hang", "ts": 1, "mono": 1, "node": "x", "cycle": 1}')  # no rank
    lines.append('{"event": "exit", "ts": 17953857')  # killed mid-write
    path.write_text("\n".join(lines) + "\n")
    result = run_cli(str(log_dir), "--no-timeline")
    assert result.exit_code == 0
    assert result.stderr.strip() == (
        f"ftrun report: warning: skipped 2 malformed line(s) in events-{NODE_B}.jsonl "
        "(first at line 4)"
    )
    assert report_of(log_dir).failures == report_of(CRASH_HANG).failures


@pytest.mark.parametrize(
    "line",
    [
        "",
        "null",
        '{"event": "exit", "ts": "x", "mono": 1, "node": "n", "cycle": 0, "code": 0}',
        '{"event": "exit", "ts": 1, "mono": 1, "node": "n", "cycle": true, "code": 0}',
        '{"event": "worker_exited", "ts": 1, "mono": 1, "node": "n", "cycle": 0, "rank": 1}',
    ],
)
def test_parse_line_rejects(line: str) -> None:
    assert parse_line(line) is None


def test_unknown_events_are_kept() -> None:
    event = parse_line('{"event": "progress", "ts": 1, "mono": 2, "node": "n", "cycle": 3}')
    assert event is not None and event.event == "progress" and dict(event.fields) == {}


# ---- synthetic jobs: what real runs rarely show ----------------------------------------------


class Job:
    """Writes events files like the launcher does; `t` is seconds from an arbitrary epoch."""

    def __init__(self, log_dir: Path, nodes: list[str]) -> None:
        self.log_dir, self.nodes = log_dir, nodes
        self.lines: dict[str, list[str]] = {n: [] for n in nodes}

    def emit(self, node: str, t: float, event: str, cycle: int, **fields: Any) -> None:
        record = {"event": event, "ts": 1e9 + t, "mono": t, "node": node, "cycle": cycle}
        self.lines[node].append(json.dumps({**record, **fields}))

    def cycle(self, number: int, t: float, nodes: list[str] | None = None) -> None:
        """Health check at t, rendezvous done at t+1, workers at t+2 on every node."""
        for i, node in enumerate(nodes or self.nodes):
            self.emit(node, t, "health_check", max(number - 1, 0), duration=0.0, checks=[])
            self.emit(
                node, t + 1, "rendezvous_done", number, duration=1.0, group_rank=i,
                nodes=nodes or self.nodes, world_size=2 * len(self.nodes), store_host=i == 0,
            )  # fmt: skip
            self.emit(node, t + 2, "workers_started", number, ranks=[2 * i, 2 * i + 1], pids=[i])

    def stepping(self, cycle: int, at: dict[str, float], iterations: int | None = None) -> None:
        """Every local rank of each node in `at` showed progress at that time."""
        for node, t in at.items():
            i = self.nodes.index(node)
            ranks, iters = [2 * i, 2 * i + 1], [iterations] * 2
            self.emit(node, t + 0.01, "stepping", cycle, ranks=ranks, progress_ts=1e9 + t,
                      progress_mono=t, iterations=iters)  # fmt: skip

    def last_progress(
        self, cycle: int, at: dict[str, float | None], iterations: int | None = None,
        before: str = "stop", written: float | None = None,
    ) -> None:  # fmt: skip
        """Each node's last progress (`written` at that time, default 0.1 s after it)."""
        for node, t in at.items():
            i = self.nodes.index(node)
            self.emit(node, written or (t or 0) + 0.1, "last_progress", cycle, before=before,
                      ranks=[2 * i, 2 * i + 1], progress_ts=None if t is None else 1e9 + t,
                      progress_mono=t, iterations=[iterations] * 2)  # fmt: skip

    def finish(self, cycle: int, t: float) -> None:
        for i, node in enumerate(self.nodes):
            for rank in (2 * i, 2 * i + 1):
                self.emit(node, t, "worker_exited", cycle, rank=rank, local_rank=rank % 2, pid=0,
                          code=0)  # fmt: skip
            self.emit(node, t + 1, "exit", cycle, code=0, reason="SUCCESS")

    def stop(self, cycle: int, t: float, restart: bool = True) -> None:
        for node in self.nodes:
            self.emit(node, t + 1, "stop_done", cycle, duration=1.0, killed=0, survivors=0)
            if restart:
                self.emit(node, t + 1, "restart", cycle)

    def write(self) -> Path:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for node, lines in self.lines.items():
            (self.log_dir / f"events-{node}.jsonl").write_text("\n".join(lines) + "\n")
        return self.log_dir


def test_preempted_job(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    job.emit("b", 100, "signal", 0, signal="SIGTERM")
    job.stop(0, 100, restart=False)
    for node in job.nodes:
        job.emit(node, 102, "exit", 0, code=75, reason="PREEMPTED")
    report = report_of(job.write())
    assert report.outcome == "PREEMPTED"
    (failure,) = report.failures
    assert (failure.kind, failure.signal, failure.nodes) == (SIGNAL, "SIGTERM", ("b",))
    assert failure.recovery_s is None and failure.lost_s == pytest.approx(2.0)
    assert report.cycles[0].ended == "signal (failure #1) -> job ended"
    assert report.effective_s == pytest.approx(98.0)


def test_budget_spent_and_signal_deaths(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    job.emit("a", 10, "worker_exited", 0, rank=1, local_rank=1, pid=1, code=-9, signal="SIGKILL")
    job.emit("b", 10.5, "worker_exited", 0, rank=2, local_rank=0, pid=2, code=1)
    job.stop(0, 11)
    for node in job.nodes:  # --max-restarts=0: the next rendezvous gives up
        job.emit(node, 13, "health_check", 0, duration=0.0, checks=[])
        job.emit(node, 13.5, "exit", 0, code=1, reason="FAILED")
    report = report_of(job.write())
    assert report.outcome == "FAILED"
    (failure,) = report.failures
    assert failure.cause == "rank 1 on a crashed: killed by SIGKILL"
    assert failure.secondary == ("rank 2 on b crashed: exit code 1 (+0.50s)",)
    assert failure.recovery_s is None
    assert report.spans[-1].state == "rendezvous"  # the last rendezvous never formed a cycle


def test_lost_node_and_restart_without_failure(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    job.stop(0, 50)  # a scale-up: nobody failed
    job.cycle(1, 52)
    job.emit("a", 60, "store_lost", 1, error="Broken pipe")  # b died without a word
    job.emit("a", 61, "stop_done", 1, duration=1.0, killed=0, survivors=0)
    job.emit("a", 62, "exit", 1, code=1, reason="FAILED")
    report = report_of(job.write())
    assert report.outcome == "INCOMPLETE"
    assert [f.kind for f in report.failures] == [RESTART, "store lost"]
    assert report.failures[0].recovery_s == pytest.approx(54 - 50)
    assert "Broken pipe" in report.failures[1].cause
    result = run_cli(str(job.log_dir), "--no-timeline")
    assert "b: no exit event" not in result.stdout  # grouped, not one entry per node
    assert "no exit event (killed?) on 1 node(s) (b)" in result.stdout


def test_earlier_runs_in_the_same_file_are_ignored(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", ["a"])
    job.cycle(0, 0)
    job.emit("a", 5, "exit", 0, code=75, reason="PREEMPTED")
    job.cycle(0, 1000)  # Slurm relaunched the job step on the same node: cycles from 0 again
    job.emit("a", 1010, "worker_exited", 0, rank=0, local_rank=0, pid=0, code=0)
    job.emit("a", 1010, "worker_exited", 0, rank=1, local_rank=1, pid=0, code=0)
    job.emit("a", 1011, "exit", 0, code=0, reason="SUCCESS")
    events = load_events(job.write())
    assert events.warnings == ("a: events of 1 earlier launcher run(s) in the same file ignored",)
    report = build_report(events)
    assert (report.outcome, report.wall_s, len(report.cycles)) == ("SUCCESS", 11.0, 1)


def test_an_event_after_the_exit_is_the_same_run(tmp_path: Path) -> None:
    """A node service may report as it closes, after the agent's `exit`: not a new run."""
    job = Job(tmp_path / "logs", ["a"])
    job.cycle(0, 0)
    job.emit("a", 5, "worker_exited", 0, rank=0, local_rank=0, pid=0, code=0)
    job.emit("a", 5, "worker_exited", 0, rank=1, local_rank=1, pid=0, code=0)
    job.emit("a", 6, "exit", 0, code=0, reason="SUCCESS")
    job.emit("a", 6.1, "ckpt_held", 0, session="s", iteration=3, world_size=2)
    events = load_events(job.write())
    assert events.warnings == ()
    report = build_report(events)
    assert (report.outcome, len(report.cycles)) == ("SUCCESS", 1)


def test_timeline_of_a_many_node_night(tmp_path: Path) -> None:
    nodes = [f"node-{i:02d}" for i in range(16)]
    job = Job(tmp_path / "logs", nodes)
    job.cycle(0, 0)
    job.emit("node-07", 3600, "hang", 0, rank=14, pid=7, kind="section", section="step",
             timeout=600.0, waited=600.2, detection_latency=0.2, stack_file="s.txt")  # fmt: skip
    job.stop(0, 3600)
    job.cycle(1, 3602)
    job.emit("node-03", 7200, "signal", 1, signal="SIGTERM")
    job.stop(1, 7200, restart=False)
    report = report_of(job.write())
    assert report.failures[0].cause.startswith("rank 14 on node-07 hung: stuck in section 'step'")
    out = tmp_path / "night.png"
    result = run_cli(str(job.log_dir), "--out", str(out))
    assert result.exit_code == 0
    assert out.stat().st_size > 20_000


def test_unhealthy_node_and_gpu_memory_wait(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    job.emit("a", 10, "worker_exited", 0, rank=0, local_rank=0, pid=0, code=1)
    job.stop(0, 10)  # stop_done at 11 on both
    job.emit("a", 14, "gpu_memory_reclaimed", 0, duration=3.0, released=True, excess_mb=0.0)
    job.emit("b", 11, "unhealthy", 0, reason="GPU 3: row remapping pending or failed")
    job.emit("b", 11, "exit", 0, code=3, reason="DO_NOT_RELAUNCH")
    job.emit("a", 14, "health_check", 0, duration=0.0, checks=[])
    job.emit("a", 20, "exit", 0, code=1, reason="FAILED")
    report = report_of(job.write())
    assert report.outcome == "FAILED"  # node a's code comes first in rank order
    node_b = next(n for n in report.nodes if n.name == "b")
    assert (node_b.unhealthy, node_b.unhealthy_at) == (
        "GPU 3: row remapping pending or failed",
        1e9 + 11,
    )
    stopping = [(s.start, s.end) for s in report.spans if s.node == "a" and s.state == "stopping"]
    assert stopping == [(1e9 + 10, 1e9 + 11), (1e9 + 11, 1e9 + 14)]
    result = run_cli(str(job.log_dir), "--out", str(tmp_path / "t.png"))
    assert "exit 3; UNHEALTHY: GPU 3: row remapping pending or failed" in result.stdout
    assert (tmp_path / "t.png").stat().st_size > 20_000


def test_unhealthy_node_never_forms_a_cycle(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", ["a"])
    job.emit("a", 0, "health_check", 0, duration=0.5, checks=["gpu"])
    job.emit("a", 1, "exit", 0, code=3, reason="DO_NOT_RELAUNCH")
    report = report_of(job.write())
    assert (report.outcome, report.cycles, report.failures) == ("DO_NOT_RELAUNCH", (), ())
    result = run_cli(str(job.log_dir), "--out", str(tmp_path / "t.png"))
    assert result.exit_code == 0 and "Cycles: none" in result.stdout


def test_ranks_text() -> None:
    assert ranks_text([3, 0, 1, 2, 7, 9, 10]) == "0-3,7,9-10"
    assert ranks_text([]) == ""


def test_load_events_error_type(tmp_path: Path) -> None:
    with pytest.raises(ReportInputError, match="no such directory"):
        load_events(tmp_path / "nope")


def copy_fixture(tmp_path: Path) -> Path:
    target = tmp_path / "logs"
    shutil.copytree(CRASH_HANG, target)
    return target


def test_the_rank_stuck_in_its_own_code_is_named_the_likely_cause(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    waiting = dict(kind="heartbeat", timeout=2.0, waited=2.0, in_library=True,
                   where="waiting inside torch/autograd/graph.py:979 in _engine_run_backward, "
                         "called from train.py:123 in train_step")  # fmt: skip
    job.emit("a", 10, "hang", 0, rank=0, pid=1, **waiting)
    job.emit("a", 10, "hang", 0, rank=1, pid=2, **waiting)
    job.emit("b", 10, "hang", 0, rank=2, pid=3, kind="heartbeat", timeout=2.0, waited=2.0,
             in_library=False, where="at train.py:63 in load_batch")  # fmt: skip
    job.emit("b", 10, "hang", 0, rank=3, pid=4, **waiting)
    job.stop(0, 10)
    where = report_of(job.write()).failures[0].hang.where
    assert where == (
        "rank 2 on b at train.py:63 in load_batch"
        "  <- likely the cause: the others wait inside libraries",
        "ranks 0-1 on a, 3 on b waiting inside torch/autograd/graph.py:979 in "
        "_engine_run_backward, called from train.py:123 in train_step",
    )
    result = run_cli(str(job.log_dir), "--no-timeline")
    assert "where: rank 2 on b at train.py:63 in load_batch  <- likely the cause" in result.output


# ---- whom a hang's ranks waited for: verdicts race, the flight recorders and stopped ranks ----

WAITING = dict(kind="heartbeat", timeout=2.0, waited=2.0, in_library=True,
               where="waiting inside torch/distributed/distributed_c10d.py:3252 in all_reduce, "
                     "called from train.py:58 in main")  # fmt: skip
STOPPED = dict(kind="heartbeat", timeout=2.0, waited=2.0, stopped=True,
               where="process stopped (SIGSTOP or a debugger; killed with SIGKILL)")  # fmt: skip


def race(tmp_path: Path, b_judged: bool, a_primary: bool = False, **finding: Any) -> Report:
    """Rank 3 (node b) stopped; node a's waiting ranks are judged first. `b_judged`: b's own
    verdicts came in too (else the cycle ended before them); `a_primary`: a named its verdict
    a cause, not a consequence; `finding`: a `collectives` event (the flight recorders')."""
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    job.stepping(0, {"a": 3, "b": 3})
    for rank in (0, 1):
        job.emit("a", 10, "hang", 0, rank=rank, pid=0, **WAITING)  # (the fixture's pids)
    job.emit("a", 10.05, "failure", 0, kind="hang", detail="heartbeat", secondary=not a_primary,
             rank=0, key="hang: heartbeat at train.py:58 in main", decision="restart")  # fmt: skip
    if b_judged:
        job.emit("b", 10.02, "hang", 0, rank=3, pid=1, **STOPPED)
        job.emit("b", 10.02, "hang", 0, rank=2, pid=1, **WAITING)
        job.emit("b", 10.04, "failure", 0, kind="hang", detail="heartbeat, process stopped",
                 rank=3, key="hang: heartbeat, process stopped", decision="restart")  # fmt: skip
    if finding:
        fields = dict(group="default_pg", seq=10, op="all_reduce", sizes="[[64]]",
                      last_completed=9, summary="the flight recorders' summary")  # fmt: skip
        job.emit("a", 10.3, "collectives", 0, **(fields | finding))
    job.stop(0, 10.3)
    job.cycle(1, 12)
    job.stepping(1, {"a": 13, "b": 13})
    job.finish(1, 20)
    return report_of(job.write())


def suspect(report: Report) -> tuple[str, int | None]:
    (found,) = report.attributions
    return found.node, found.rank


def test_a_stopped_rank_is_the_hang_s_culprit_whichever_verdict_came_first(tmp_path: Path):
    report = race(tmp_path, b_judged=True)
    (failure,) = report.failures
    assert (failure.kind, failure.ranks, failure.nodes) == (HANG, (3,), ("b",))
    assert failure.cause.startswith("rank 3 on b hung (process stopped); ranks 2 on b, 0-1 on a")
    assert not failure.notes
    assert failure.hang is not None and failure.hang.where[0].startswith("rank 3 on b process")
    assert suspect(report) == ("b", 3)


def test_the_flight_recorders_finding_overrides_the_first_verdict_s_rank(tmp_path: Path):
    # Node a's rank 0 was judged first, and named as the cause; the flight recorders saw
    # rank 2 never enter the collective the others wait in.
    report = race(tmp_path, b_judged=False, a_primary=True, entered=[0, 1, 3], missing=[2],
                  no_dump=[], suspects=["b"])  # fmt: skip
    (failure,) = report.failures
    assert (failure.ranks, failure.nodes) == ((2,), ("b",))
    assert "rank 2 on b hung (never entered all_reduce seq 10, by the flight recorders)" in (
        failure.cause
    )
    assert suspect(report) == ("b", 2)
    assert report.attributions[0].signature == "hang: heartbeat at train.py:58 in main"
    text = run_cli(str(tmp_path / "logs"), "--no-timeline").output
    assert "suspect: b rank 2" in text


def test_no_dump_names_the_culprit_only_when_nothing_stronger_does(tmp_path: Path):
    # Rank 1 sent no dump either: it died when node b killed its hung ranks at once.
    seen = dict(entered=[0, 2], missing=[], no_dump=[1, 3], suspects=["a", "b"])
    stopped = race(tmp_path / "stopped", b_judged=True, **seen)
    assert (stopped.failures[0].ranks, suspect(stopped)) == ((3,), ("b", 3))
    unjudged = race(tmp_path / "unjudged", b_judged=False, **seen)
    assert unjudged.failures[0].ranks == (1, 3)
    assert "ranks 1 on a, 3 on b hung (no flight-recorder dump" in unjudged.failures[0].cause
    assert suspect(unjudged) == ("a", 1)


# ---- a real run: the report against the workers' own step logs -------------------------------


def step_logs(ckpt_dir: Path, ranks: int) -> dict[int, list[tuple[int, str, float]]]:
    """rank -> [(cycle, step or "crash", wall time)] from tests/workers/progress_worker.py."""
    logs = {}
    for rank in range(ranks):
        rows = (
            line.split() for line in (ckpt_dir / f"steps-rank{rank}.txt").read_text().splitlines()
        )
        logs[rank] = [(int(cycle), what, float(at)) for cycle, what, at in rows]
    return logs


STARTUP_S, CRASH_STEP, SAVE_EVERY = 1.5, 8, 5
WORKER_ARGS = ["--steps", "14", "--step-time", "0.05", "--startup", str(STARTUP_S),
               "--save-every", str(SAVE_EVERY), "--crash", f"0:1:{CRASH_STEP}"]  # fmt: skip


def check_against_step_logs(log_dir: Path, steps_dir: Path) -> Report:
    """The report of a 2 x 2-rank run of progress_worker.py WORKER_ARGS against the ranks' own
    step logs: recovery (the crash to every rank stepping again), time lost and the effective
    training time within 10 %, the iterations redone exact. The ranks start up for 1.5 s: a
    report counting processes would call the recovery a fraction of that."""
    logs = step_logs(steps_dir, 4)
    crashed_at = next(at for cycle, what, at in logs[1] if what == "crash")
    steps = {c: [[(int(w), at) for cycle, w, at in rows if cycle == c and w != "crash"]
                 for rows in logs.values()] for c in (0, 1)}  # fmt: skip
    stepping = {c: max(ranks[0][1] for ranks in steps[c]) for c in (0, 1)}
    last_before = min(max(at for ranks in steps[0] for _, at in ranks), crashed_at)
    finished = max(ranks[-1][1] for ranks in steps[1])
    redone = (CRASH_STEP - 1) - SAVE_EVERY  # steps 6 and 7, again from the step-5 checkpoint
    pace = (last_before - stepping[0]) / (CRASH_STEP - 2)  # step 1 to step 7

    report = report_of(log_dir)
    assert report.progress_reported
    (failure,) = report.failures
    assert failure.kind == CRASH and failure.ranks == (1,)
    assert failure.recovery_s == pytest.approx(stepping[1] - crashed_at, rel=0.10)
    assert failure.recovery_s > STARTUP_S  # start-up counts: the ranks were not training
    assert failure.lost_s == pytest.approx(stepping[1] - last_before, rel=0.10)
    assert failure.redone_iterations == redone
    assert failure.redone_s == pytest.approx(redone * pace, rel=0.10)
    useful = (last_before - stepping[0]) + (finished - stepping[1]) - redone * pace
    assert report.effective_s == pytest.approx(useful, rel=0.10)
    assert report.startup_s is not None and report.startup_s > STARTUP_S
    return report


@pytest.mark.process
def test_recovery_matches_the_workers_own_step_logs(tmp_path: Path) -> None:
    """Acceptance (issue 13): a live run through the launcher, the report against the logs."""
    job = start_job(tmp_path, 2, ["--max-restarts=1"], WORKER_ARGS, script=PROGRESS_WORKER, nproc=2)
    assert job.wait(120) == [0, 0], job.nodes[0].text()[-3000:]
    check_against_step_logs(job.log_dir, job.ckpt_dir)
    result = run_cli(str(job.log_dir), "--out", str(tmp_path / "timeline.png"))
    assert result.exit_code == 0, result.output
    assert "effective (ETTR, from training progress)" in result.stdout
    assert "| 2 iteration(s) redone" in result.stdout
    assert (tmp_path / "timeline.png").read_bytes().startswith(PNG_MAGIC)


def test_a_recorded_run_matches_its_step_logs() -> None:
    """The same check on the events and step logs of one such run, kept in tests/data."""
    report = check_against_step_logs(PROGRESS_CRASH, PROGRESS_CRASH / "steps")
    assert report.outcome == "SUCCESS" and len(report.cycles) == 2


# ---- training progress: what the ranks did, not what the processes did -----------------------


def crash_job(tmp_path: Path) -> Job:
    """Two nodes; ranks step from t=13 (b is the slower to start) at iterations 1..70; rank 1
    crashes at t=50 (b's ranks still stepped at 50.1, alone: no progress the job keeps); cycle
    1 steps from t=64.5 at iteration 61 (the checkpoint was at 60), and finishes at t=100."""
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    job.stepping(0, {"a": 12, "b": 13}, iterations=1)
    job.emit("a", 50, "worker_exited", 0, rank=1, local_rank=1, pid=1, code=1)
    job.last_progress(0, {"a": 49.5, "b": 50.1}, iterations=70)
    job.stop(0, 50)
    job.cycle(1, 52)
    job.stepping(1, {"a": 60, "b": 64.5}, iterations=61)
    job.last_progress(1, {"a": 99.5, "b": 99.8}, iterations=120, before="finished", written=100)
    job.finish(1, 100)
    job.write()
    return job


def test_recovery_and_time_lost_are_measured_on_progress(tmp_path: Path) -> None:
    report = report_of(crash_job(tmp_path).log_dir)
    assert report.progress_reported
    (crash,) = report.failures
    assert crash.kind == CRASH and crash.ts == 1e9 + 50
    assert crash.recovered_at == 1e9 + 64.5  # the slower node's ranks stepping again
    assert crash.recovery_s == pytest.approx(14.5)  # not 4 s: crash to workers started
    assert crash.last_healthy == 1e9 + 50  # b's step at 50.1 came after the crash
    assert crash.lost_s == pytest.approx(14.5)
    assert [c.stepping_at for c in report.cycles] == [1e9 + 13, 1e9 + 64.5]
    assert [c.training_until for c in report.cycles] == [1e9 + 50, 1e9 + 99.8]


def test_iterations_redone_and_the_effective_training_ratio(tmp_path: Path) -> None:
    report = report_of(crash_job(tmp_path).log_dir)
    (crash,) = report.failures
    assert crash.redone_iterations == 10  # 61..70 again
    pace = (50 - 13) / (70 - 1)
    assert crash.redone_s == pytest.approx(10 * pace)
    assert report.startup_s == pytest.approx(13)  # launch to every rank stepping
    training = (50 - 13) + (99.8 - 64.5)
    assert report.effective_s == pytest.approx(training - 10 * pace)
    assert report.effective_ratio == pytest.approx((training - 10 * pace) / 101)
    assert report.running_s == pytest.approx((50 - 2) + (100 - 54))  # process time, kept


def test_the_text_says_progress_and_how_costs_were_measured(tmp_path: Path) -> None:
    result = run_cli(str(crash_job(tmp_path).log_dir), "--no-timeline")
    assert result.exit_code == 0
    text = result.stdout
    for expected in (
        "Training   66.3% effective (ETTR, from training progress): 1m07s making progress of 1m41s",
        "lost: start-up 13.00s (launch to every rank stepping), failures 14.50s (last progress "
        "to stepping again), work redone ~5.36s",
        "  cycle  start     rendezvous   start-up     training        stop  ended",
        "     1.00s      11.00s       37.00s       1.00s  crash (failure #1) -> restart",
        "Failures (1)  recovery: to every rank stepping again; time lost: from the last progress",
        "detection 0s (immediate) | recovery 14.50s | time lost 14.50s | 10 iteration(s) "
        "redone (~5.36s)",
    ):
        assert expected in text, text
    assert "no training progress reported" not in text


def test_a_hang_loses_from_the_last_progress_not_from_the_timeout(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    job.stepping(0, {"a": 5, "b": 5})
    job.emit("b", 50, "hang", 0, rank=2, pid=2, kind="heartbeat", timeout=4.0, waited=4.0)
    job.last_progress(0, {"a": 40.0, "b": 41.0}, written=50.1)  # data loading stalled at 41
    job.stop(0, 50)
    job.cycle(1, 52)
    job.stepping(1, {"a": 58, "b": 57})
    job.finish(1, 70)
    (hang,) = report_of(job.write()).failures
    assert hang.detection_s == 4.0  # the monitor's own measure, as before
    assert hang.last_healthy == 1e9 + 41  # not 50 - 4: the progress the ranks reported
    assert hang.lost_s == pytest.approx(58 - 41)
    assert hang.recovery_s == pytest.approx(8)
    assert hang.redone_iterations is None and hang.redone_s is None  # no iterations reported


def test_a_cycle_that_never_stepped_is_no_recovery(tmp_path: Path) -> None:
    """Cycle 1 failed while its ranks were starting: the job recovered only in cycle 2, and
    the start-up failure lost nothing of its own beyond that window."""
    job = Job(tmp_path / "logs", ["a", "b"])
    job.cycle(0, 0)
    job.stepping(0, {"a": 5, "b": 5})
    job.emit("a", 30, "worker_exited", 0, rank=0, local_rank=0, pid=1, code=1)
    job.last_progress(0, {"a": 29.9, "b": 29.95})
    job.stop(0, 30)
    job.cycle(1, 32)
    job.stepping(1, {"a": 40})  # b's ranks never stepped
    job.emit("b", 41, "worker_exited", 1, rank=2, local_rank=0, pid=2, code=-11, signal="SIGSEGV")
    job.last_progress(1, {"a": 40.8, "b": None})
    job.stop(1, 41)
    job.cycle(2, 43)
    job.stepping(2, {"a": 50, "b": 51})
    job.finish(2, 60)
    report = report_of(job.write())
    first, second = report.failures
    assert first.recovered_at == second.recovered_at == 1e9 + 51
    assert first.recovery_s == pytest.approx(21) and first.lost_s == pytest.approx(51 - 29.95)
    assert second.last_healthy == 1e9 + 41 and second.lost_s == pytest.approx(10)
    assert report.cycles[1].stepping_at is None and report.cycles[1].training_until is None
    assert report.effective_s == pytest.approx((29.95 - 5) + (60 - 51))
    text = run_cli(str(job.log_dir), "--no-timeline").stdout
    assert "      never            -" in text  # cycle 1: started, never all stepping


def test_lanes_show_start_up_and_stalls_as_not_training(tmp_path: Path) -> None:
    report = report_of(crash_job(tmp_path).log_dir)
    lane = [(s.state, s.start - 1e9, s.end - 1e9) for s in report.spans if s.node == "a"]
    assert lane == [
        ("rendezvous", 0, 2),
        ("starting", 2, 12),
        ("running", 12, 49.5),
        ("stalled", 49.5, 50),  # last progress to the stop
        ("stopping", 50, 51),
        ("rendezvous", 52, 54),
        ("starting", 54, 60),
        ("running", 60, 100),
        ("finished", 100, 101),
    ]


def test_the_timeline_of_a_progress_report(tmp_path: Path) -> None:
    job = crash_job(tmp_path)
    out = tmp_path / "t.png"
    assert run_cli(str(job.log_dir), "--out", str(out)).exit_code == 0
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 20_000


def test_without_matplotlib_the_summary_prints_and_says_how_to_get_the_picture(
    tmp_path: Path,
) -> None:
    log_dir = copy_fixture(tmp_path)
    hide = "import sys; sys.modules['matplotlib'] = None\nfrom ftrun.tools.cli import main; main()"
    for extra in ([], ["--json"]):
        proc = subprocess.run(
            [sys.executable, "-c", hide, "report", str(log_dir), *extra],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        if extra:
            data = json.loads(proc.stdout)  # stdout stays JSON; the note goes to stderr
            assert data["timeline"] is None and "matplotlib" in data["timeline_note"]
            assert "pip install 'ftrun[report]'" in proc.stderr
        else:
            assert "Outcome    SUCCESS" in proc.stdout
            assert proc.stdout.rstrip().endswith(
                "Timeline   not drawn: matplotlib is not installed (pip install 'ftrun[report]')"
            )
    assert not (log_dir / "timeline.png").exists()


# ---- the events schema: one for the writer and the reader ------------------------------------


def test_every_event_the_launcher_writes_is_in_the_schema() -> None:
    src = Path(ftrun.__file__).parent
    emitted = set()
    for path in src.rglob("*.py"):
        emitted |= set(re.findall(r'emit\w*\(\s*"(\w+)"', path.read_text()))
    assert {"stepping", "last_progress", "worker_exited", "hang", "exit"} <= emitted
    assert emitted - set(SCHEMA) == set()


def test_the_reader_requires_what_the_schema_requires() -> None:
    base = '"ts": 1, "mono": 1, "node": "n", "cycle": 0'
    assert parse_line(f'{{"event": "stepping", {base}, "ranks": [0], "progress_ts": 5}}') is None
    event = parse_line(
        f'{{"event": "stepping", {base}, "ranks": [0], "progress_ts": 5, "progress_mono": 2}}'
    )
    assert event is not None and event.num("progress_ts") == 5
    ok = f'{{"event": "last_progress", {base}, "before": "stop", "ranks": [], "progress_ts": null}}'
    assert parse_line(ok) is not None
    assert events_schema.problems("last_progress", {"before": "stop"}) == [
        "last_progress: required field 'ranks' missing"
    ]


def test_the_writer_checks_the_schema_and_writes_anyway(tmp_path: Path, caplog) -> None:
    log = EventLog(tmp_path, "n")
    log.emit("stepping", ranks=[0], progress_ts="soon", progress_mono=1.0)
    log.emit("no_such_event")
    log.close()
    assert "field 'progress_ts' is not a number: 'soon'" in caplog.text
    assert "unknown event kind 'no_such_event'" in caplog.text
    lines = (tmp_path / "events-n.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["stepping", "no_such_event"]


# ---- the agent's side: CycleReport turns the monitor's notes into events -----------------------


def cycle_report(tmp_path: Path) -> tuple[CycleReport, EventLog]:
    events = EventLog(tmp_path, "n")
    runtime = types.SimpleNamespace(
        events=events, node="n", node_log_dir=tmp_path / "n", job_dir=tmp_path
    )
    return CycleReport(runtime), events  # type: ignore[arg-type]


def written(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "events-n.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_stepping_is_emitted_once_every_local_rank_progressed(tmp_path: Path) -> None:
    report, events = cycle_report(tmp_path)
    events.cycle = 3
    report.expect_progress([4, 5], [100, 101])
    now = time.monotonic()
    report.first_progress(FirstProgress(4, 100, 100, now, 12))
    report.first_progress(FirstProgress(5, 999, 999, now, 12))  # a stale worker's note
    report.first_progress(FirstProgress(4, 100, 100, now + 1, 13))  # a duplicate
    assert [e["event"] for e in written(tmp_path)] == ["rank_startup"]
    report.first_progress(FirstProgress(5, 7, 101, now + 0.5, None))  # a descendant of 101
    report.first_progress(FirstProgress(5, 7, 101, now + 0.6, None))
    events.close()
    (stepping,) = [e for e in written(tmp_path) if e["event"] == "stepping"]
    assert stepping["event"] == "stepping" and stepping["cycle"] == 3
    assert (stepping["ranks"], stepping["iterations"]) == ([4, 5], [12, None])
    assert stepping["progress_mono"] == pytest.approx(now + 0.5, abs=1e-5)
    wall = stepping["ts"] - (stepping["mono"] - (now + 0.5))
    assert stepping["progress_ts"] == pytest.approx(wall, abs=1e-3)
    assert 0 < stepping["startup"] < 5
    assert events_schema.problems("stepping", stepping) == []


def test_rank_startup_splits_a_forked_ranks_start_from_its_marks(tmp_path: Path) -> None:
    """A forked worker's marks (script, CUDA, process group) become seconds from the spawns'
    start; a rank without marks was spawned fresh, and its file is read once and removed."""
    report, events = cycle_report(tmp_path)
    start = time.monotonic()
    report.expect_progress([0, 1], [100, 101], start)
    marks_path(tmp_path, 100).write_text(
        f"script {start + 0.01}\ncuda {start + 0.3}\npg {start + 0.6}\ngarbage\ncuda nan\n"
    )
    report.first_progress(FirstProgress(0, 100, 100, start + 1.5, 1))
    report.first_progress(FirstProgress(1, 101, 101, start + 2.0, 1))
    events.close()
    forked, spawned = [e for e in written(tmp_path) if e["event"] == "rank_startup"]
    assert (forked["rank"], forked["path"]) == (0, "forked")
    assert forked["to_script"] == pytest.approx(0.01, abs=1e-5)
    assert forked["to_cuda"] == pytest.approx(0.3, abs=1e-5)
    assert forked["to_pg"] == pytest.approx(0.6, abs=1e-5)
    assert forked["to_first_step"] == pytest.approx(1.5, abs=1e-5)
    assert (spawned["path"], spawned["to_cuda"], spawned["to_first_step"]) == (
        "spawned", None, pytest.approx(2.0, abs=1e-5))  # fmt: skip
    assert not marks_path(tmp_path, 100).exists()
    assert events_schema.problems("rank_startup", forked) == []


def test_a_rank_without_progress_gets_its_split_when_the_cycle_ends(tmp_path: Path) -> None:
    """No RankMonitorClient, no first step: the marks still reach the events, once."""
    report, events = cycle_report(tmp_path)
    start = time.monotonic()
    report.expect_progress([0], [100], start)
    marks_path(tmp_path, 100).write_text(f"script {start + 0.01}\npg {start + 0.5}\n")
    report.last_progress([], before="stop")
    report.last_progress([], before="stop")  # nothing twice
    events.close()
    (split,) = [e for e in written(tmp_path) if e["event"] == "rank_startup"]
    assert (split["path"], split["to_first_step"]) == ("forked", None)
    assert split["to_pg"] == pytest.approx(0.5, abs=1e-5)
    assert events_schema.problems("rank_startup", split) == []
    (line,) = list(startup_lines(startup_splits([Event("rank_startup", 0, 0, "n", 0, split)])))[3:]
    assert line.split() == ["0", "0", "forked", "0.01s", "-", "0.50s", "-", "-"]


def test_the_report_shows_each_cycles_slowest_rank_start() -> None:
    """`ftrun report`: per cycle, the rank that stepped last, where its start-up went."""

    def startup(cycle: int, rank: int, path: str, first: float, pg: float | None) -> Event:
        cuda = None if pg is None else pg / 2
        fields = {"rank": rank, "pid": 10 + rank, "path": path, "to_script": 0.01,
                  "to_cuda": cuda, "to_pg": pg, "to_first_step": first}  # fmt: skip
        return Event("rank_startup", 0.0, 0.0, "n0", cycle, fields)

    splits = startup_splits([
        startup(1, 0, "forked", 1.2, 0.5), startup(1, 1, "forked", 2.0, 0.6),
        startup(0, 0, "spawned", 9.0, None), startup(0, 1, "forked", 3.0, 1.0),
    ])  # fmt: skip
    assert [(s.cycle, s.rank, s.path, s.ranks) for s in splits] == [
        (0, 0, "mixed", 2), (1, 1, "forked", 2)]  # fmt: skip
    lines = list(startup_lines(splits))
    assert lines[1].startswith("Start-up by cycle")
    assert lines[3].split() == ["0", "0", "mixed", "0.01s", "-", "-", "9.00s", "-"]
    assert lines[4].split() == ["1", "1", "forked", "0.01s", "0.30s", "0.60s", "2.00s", "1.40s"]
    assert list(startup_lines(())) == []


def test_last_progress_from_a_snapshot(tmp_path: Path) -> None:
    report, events = cycle_report(tmp_path)
    now = time.monotonic()
    report.last_progress([
        ProgressSnapshot(1, 11, 11, now - 9, now - 2, 3, 40),
        ProgressSnapshot(0, 10, 10, now - 9, now - 1, 3, 41),
        ProgressSnapshot(2, 12, 12, None, None, None, None),  # never stepped
    ])  # fmt: skip
    report.last_progress([], before="finished")
    events.close()
    stop, finish = written(tmp_path)
    assert (stop["before"], stop["ranks"]) == ("stop", [0, 1, 2])
    assert stop["iterations"] == [41, 40, None]
    assert stop["progress_mono"] == pytest.approx(now - 1, abs=1e-5)
    wall = stop["ts"] - (stop["mono"] - (now - 1))
    assert stop["progress_ts"] == pytest.approx(wall, abs=1e-3)
    assert (finish["before"], finish["ranks"], finish["progress_ts"]) == ("finished", [], None)
    assert all(events_schema.problems(e["event"], e) == [] for e in (stop, finish))
