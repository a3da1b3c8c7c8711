"""Process-level tests of the heartbeat path: real ranks, a real server, real signals."""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ftrun.client_lib import RankMonitorClient, RankMonitorClientError
from ftrun.rank_monitor import (
    FirstProgress,
    HangKind,
    ProgressSnapshot,
    RankMonitorConfig,
    RankMonitorServer,
    Verdict,
)
from ftrun.rank_monitor.process_state import can_answer, cannot_act
from ftrun.rank_monitor.stacks import StuckAt, where_stuck
from support import python_cmd, wait_for

# How soon after its deadline a verdict comes is measured by the fault matrix
# (tests/faults/run_matrix.py, detection latency in bench/RESULTS.md), not asserted here.


def spawn_rank(server: RankMonitorServer, rank: int, *args: str) -> subprocess.Popen[str]:
    env = {**server.worker_env(), "RANK": str(rank), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        python_cmd("monitor_worker.py", *args), env=env, stdout=subprocess.PIPE, text=True
    )
    server.expect_rank(rank, proc.pid)
    return proc


def await_verdict(server: RankMonitorServer, proc: subprocess.Popen[str]) -> tuple[Verdict, float]:
    with proc:
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 30)
            assert ready, "the rank did not say it is stuck within 30 s"
            assert proc.stdout.readline().strip() == "stuck"
            verdict = server.verdicts.get(timeout=10)
            return verdict, time.monotonic()
        finally:
            proc.kill()


def check_timing(verdict: Verdict, arrived: float, timeout: float) -> None:
    assert verdict.timeout == pytest.approx(timeout)
    assert verdict.detected_at >= verdict.deadline  # never before the deadline
    assert arrived >= verdict.detected_at
    assert verdict.waited >= timeout


@pytest.mark.process  # starts a real rank (`spawn_rank`)
@pytest.mark.parametrize(
    ("mode", "timeouts", "kind", "section", "timeout"),
    [
        (
            "never_sends_first_heartbeat",
            {"initial_rank_heartbeat_timeout": 0.4},
            HangKind.NO_FIRST_HEARTBEAT,
            None,
            0.4,
        ),
        ("stops_heartbeating", {"rank_heartbeat_timeout": 0.3}, HangKind.HEARTBEAT, None, 0.3),
        (
            "stuck_in_section",
            {"initial_rank_heartbeat_timeout": None, "rank_section_timeouts": {"step": 0.3}},
            HangKind.SECTION,
            "step",
            0.3,
        ),
        (
            "too_long_out_of_section",
            {"initial_rank_heartbeat_timeout": None, "rank_out_of_section_timeout": 0.3},
            HangKind.OUT_OF_SECTION,
            None,
            0.3,
        ),
    ],
)
def test_hang_verdict_on_time_with_stack(make_server, mode, timeouts, kind, section, timeout):
    server = make_server(**timeouts)
    proc = spawn_rank(server, 3, mode)
    verdict, arrived = await_verdict(server, proc)
    assert (verdict.rank, verdict.pid, verdict.kind, verdict.section) == (
        3,
        proc.pid,
        kind,
        section,
    )
    check_timing(verdict, arrived, timeout)
    assert f"in {mode}" in verdict.stack, verdict.stack
    assert verdict.stack_file is not None
    assert mode in verdict.stack_file.read_text()
    assert f"rank 3 (pid {proc.pid}) hung" in verdict.describe()
    # The stuck frame is read once, when the stacks come in; its users read the verdict's.
    assert verdict.stuck == where_stuck(verdict.stack)
    stuck = verdict.stuck
    assert stuck is not None and not stuck.in_library and f" in {mode}" in stuck.frame, stuck


def test_where_stuck_reads_the_main_thread_and_skips_library_frames():
    dump = """Thread 0x00007f3e7fb296c0 (most recent call first):
  File "/x/train.py", line 86 in wait_for_term
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f3e9f486b80 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/usr/lib/python3.11/contextlib.py", line 81 in inner
  File "/x/train.py", line 124 in train_step
  File "/x/train.py", line 199 in <module>
"""
    stuck = where_stuck(dump)
    assert stuck == StuckAt(
        "torch/autograd/graph.py:979 in _engine_run_backward", True, "train.py:124 in train_step"
    )
    assert stuck.describe() == (
        "waiting inside torch/autograd/graph.py:979 in _engine_run_backward, "
        "called from train.py:124 in train_step"
    )
    assert where_stuck("(the rank did not dump its stacks)") is None


@pytest.mark.process  # starts a real rank (`spawn_rank`)
def test_calculated_timeouts_survive_a_new_process(make_server, tmp_path: Path):
    server = make_server(calculated_timeout_floor=0.0)  # judge the milliseconds
    state_file = tmp_path / "state.json"
    with spawn_rank(server, 0, "calculate", str(state_file)) as first:
        assert first.communicate(timeout=30)[0].strip() == "done"
    saved = json.loads(state_file.read_text())["current_timeouts"]  # NVRx's form
    hb = saved["heartbeat"]["subsequent"]
    assert 5 * 0.05 <= hb < 5 * 0.06 + 1.0  # 5x the ~60 ms heartbeat interval, less arrival jitter
    # 5x the 30 ms section and the 30 ms between sections, as the monitor saw them: it times
    # them between the arrivals of messages, so a message delayed under load shortens one.
    assert 5 * 0.01 <= saved["section"]["section"]["step"] < 5 * 0.03 + 1.0
    assert saved["section"]["out_of_section"] >= 5 * 0.01
    assert saved["section"]["is_out_of_section_calculated"]

    with spawn_rank(server, 0, "restore", str(state_file)) as second:
        out, _ = second.communicate(timeout=30)
    assert second.returncode == 0
    assert json.loads(out)["current_timeouts"] == saved


def test_restored_timeouts_are_enforced_by_the_server(make_server, monkeypatch):
    server = make_server(rank_heartbeat_timeout=60.0, calculated_timeout_floor=0.0)
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(0, os.getpid())
    client = RankMonitorClient()
    client.load_state_dict({"heartbeat": {"initial": 60.0, "subsequent": 0.3}})
    client.init_workload_monitoring()
    try:
        client.send_heartbeat()
        verdict = server.verdicts.get(timeout=10)  # the 60 s default would never fire here
        arrived = time.monotonic()
    finally:
        client.shutdown_workload_monitoring()
    assert verdict.kind is HangKind.HEARTBEAT
    check_timing(verdict, arrived, 0.3)


def test_goodbye_ends_monitoring(make_server, monkeypatch):
    server = make_server(rank_heartbeat_timeout=0.2)
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(0, os.getpid())
    client = RankMonitorClient()
    client.init_workload_monitoring()
    client.send_heartbeat()
    client.shutdown_workload_monitoring()
    with pytest.raises(queue.Empty):
        server.verdicts.get(timeout=0.6)


def test_client_misuse_raises_clear_errors(make_server, monkeypatch):
    client = RankMonitorClient()
    with pytest.raises(RankMonitorClientError, match="before init_workload_monitoring"):
        client.send_heartbeat()
    with pytest.raises(RankMonitorClientError, match="FTRUN_MONITOR_ADDR is not set"):
        monkeypatch.delenv("FTRUN_MONITOR_ADDR", raising=False)
        client.init_workload_monitoring()
    server = make_server()
    for key, value in {**server.worker_env(), "RANK": "7"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RankMonitorClientError, match="rank 7 is not expected here"):
        client.init_workload_monitoring()
    server.expect_rank(7, os.getpid())
    client.init_workload_monitoring()
    try:
        with pytest.raises(
            RankMonitorClientError, match=r"end_section\('step'\) but that section is not open"
        ):
            client.end_section("step")
        client.start_section("step")
        with pytest.raises(RankMonitorClientError, match="already open"):
            client.start_section("step")
        with pytest.raises(RankMonitorClientError, match="not observed yet"):
            client.calculate_and_set_hb_timeouts()
        assert client.calculate_and_set_hb_timeouts(skip_if_not_ready=True) is False
        with pytest.raises(RankMonitorClientError, match="already called"):
            client.init_workload_monitoring()
        with pytest.raises(RankMonitorClientError, match="not a RankMonitorClient state_dict"):
            client.load_state_dict({"bogus": 1})
    finally:
        client.shutdown_workload_monitoring()


# ---- training progress, for reports ----------------------------------------------------------


def test_first_progress_is_noted_once_per_registration_with_its_iteration(
    make_server, in_process_client
):
    notes: queue.SimpleQueue[FirstProgress] = queue.SimpleQueue()
    server = make_server(on_progress=notes.put)
    client = in_process_client(server, 5)
    client.start_section("step")  # not progress: the step has not been done yet
    with pytest.raises(queue.Empty):
        notes.get(timeout=0.3)
    before = time.monotonic()
    client.end_section("step", iteration=41)
    client.send_heartbeat(iteration=41)
    client.start_section("step")
    client.end_section("step")
    client.send_heartbeat(iteration=42)
    note = notes.get(timeout=5)
    me = os.getpid()
    assert (note.rank, note.pid, note.worker_pid, note.iteration) == (5, me, me, 41)
    assert before <= note.at <= time.monotonic()
    snapshot = wait_for(
        lambda: (s := server.progress_snapshot()) and s[0].last_iteration == 42 and s,
        5,
        "the second step in the snapshot",
    )
    timeouts = snapshot[0].timeouts  # the configured ones: nothing calculated yet
    assert timeouts is not None and timeouts.heartbeat == 60.0
    assert snapshot == [
        ProgressSnapshot(5, me, me, note.at, snapshot[0].last_progress, 41, 42, timeouts)
    ]
    assert snapshot[0].last_progress > note.at
    with pytest.raises(queue.Empty):
        notes.get(timeout=0.3)  # once per registration


def test_progress_without_iterations(make_server, in_process_client):
    notes: list[FirstProgress] = []
    server = make_server(on_progress=notes.append)
    client = in_process_client(server, 0)
    client.send_heartbeat()
    wait_for(lambda: notes, 5, "the first progress")
    assert notes[0].iteration is None
    (snap,) = server.progress_snapshot()
    assert (snap.first_iteration, snap.last_iteration) == (None, None)
    assert snap.first_progress == snap.last_progress == notes[0].at


def test_snapshot_outlives_a_verdict_and_a_goodbye_but_not_forget(make_server, monkeypatch):
    """The agent snapshots before it stops the workers: a hung rank (its registration ended
    with the verdict) and a rank that said goodbye still tell where they got to."""
    server = make_server(rank_heartbeat_timeout=0.2)
    for key, value in {**server.worker_env(), "RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(1, os.getpid())
    client = RankMonitorClient()
    client.init_workload_monitoring()
    try:
        client.send_heartbeat(iteration=9)
        assert server.verdicts.get(timeout=10).rank == 1
    finally:
        client.shutdown_workload_monitoring()
    (snap,) = server.progress_snapshot()
    assert (snap.rank, snap.last_iteration) == (1, 9) and snap.last_progress is not None
    server.forget_all()
    assert server.progress_snapshot() == []


def test_a_broken_progress_callback_does_not_stop_hang_detection(make_server, in_process_client):
    def broken(_note: FirstProgress) -> None:
        raise RuntimeError("owner bug")

    server = make_server(on_progress=broken, rank_heartbeat_timeout=0.3)
    client = in_process_client(server, 2)
    client.send_heartbeat()
    verdict = server.verdicts.get(timeout=10)
    assert (verdict.rank, verdict.kind) == (2, HangKind.HEARTBEAT)


@pytest.mark.process  # starts a real rank (`spawn_rank`)
def test_iterations_from_a_real_rank(make_server):
    notes: list[FirstProgress] = []
    server = make_server(on_progress=notes.append)
    with spawn_rank(server, 4, "progress", "3") as proc:
        assert proc.communicate(timeout=30)[0].strip() == "done"
    assert proc.returncode == 0
    assert [(n.rank, n.iteration, n.worker_pid) for n in notes] == [(4, 1, proc.pid)]
    (snap,) = server.progress_snapshot()
    assert (snap.first_iteration, snap.last_iteration) == (1, 3)


def test_nvrx_call_signatures_stay_valid(make_server, in_process_client):
    """NVRx 0.4's client: send_heartbeat(), start_section(section), end_section(section)."""
    notes: list[FirstProgress] = []
    server = make_server(on_progress=notes.append)
    client = in_process_client(server, 0)
    client.start_section(section="step")
    client.end_section(section="step")
    client.send_heartbeat()
    client.end_all_sections()
    wait_for(lambda: [n.rank for n in notes] == [0], 5, "rank 0's progress")


@pytest.mark.parametrize(
    ("iteration", "error"),
    [(-1, "in \\[0, "), (2**62 + 1, "in \\[0, "), (1.5, "not float"), ("3", "not str"),
     (True, "not bool")],
)  # fmt: skip
def test_bad_iterations_raise_clear_errors(make_server, in_process_client, iteration, error):
    server = make_server()
    client = in_process_client(server, 0)
    with pytest.raises(RankMonitorClientError, match=f"iteration must be.*{error}"):
        client.send_heartbeat(iteration=iteration)
    client.start_section("step")
    with pytest.raises(RankMonitorClientError, match=f"iteration must be.*{error}"):
        client.end_section("step", iteration=iteration)


def test_integer_like_iterations_are_accepted(make_server, in_process_client):
    numpy = pytest.importorskip("numpy")
    notes: list[FirstProgress] = []
    server = make_server(on_progress=notes.append)
    client = in_process_client(server, 0)
    client.send_heartbeat(iteration=numpy.int64(2**40))
    wait_for(lambda: notes, 5, "the first progress")
    assert notes[0].iteration == 2**40


def test_a_slow_stack_capture_delays_no_other_rank_s_verdict(tmp_path: Path, in_process_client):
    """Rank 0 hangs first and its stacks take 3 s to capture (a fake capture); rank 1 hangs
    0.5 s later. Rank 1's verdict comes on time, before rank 0's: capturing happens off the
    monitor thread, one thread per batch of hung ranks."""
    release = threading.Event()

    def capture(targets, sig, timeout):
        if any("rank0-" in path.name for _, path in targets):
            release.wait(3.0)
        return {path: f"stack of {path.name}" for _, path in targets}

    config = RankMonitorConfig(initial_rank_heartbeat_timeout=0.5, rank_heartbeat_timeout=1.0)
    server = RankMonitorServer(config, job_dir=tmp_path / "job", capture=capture).start()
    try:
        started = time.monotonic()
        in_process_client(server, 0)  # never sends a heartbeat: hung at 0.5 s
        in_process_client(server, 1).send_heartbeat()  # hung at about 1.0 s
        first = server.verdicts.get(timeout=10)
        assert first.rank == 1 and time.monotonic() - started < 2.5, first
        assert first.stack.startswith("stack of rank1-")
        release.set()
        second = server.verdicts.get(timeout=10)
        assert second.rank == 0 and second.detected_at < first.detected_at
    finally:
        release.set()
        server.stop()


def test_the_verdict_carries_where_the_rank_is_stuck_read_once(tmp_path: Path, in_process_client):
    """The stuck frame is read from the dump when the stacks come in (the reporting and the
    attribution read `Verdict.stuck`, never the dump again)."""
    dump = (
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
        "line 3252 in all_reduce\n"
        '  File "/job/train.py", line 40 in step\n'
    )
    config = RankMonitorConfig(initial_rank_heartbeat_timeout=0.3)
    server = RankMonitorServer(config, job_dir=tmp_path / "job",
                               capture=lambda targets, sig, timeout: {
                                   path: dump for _, path in targets}).start()  # fmt: skip
    try:
        in_process_client(server, 0)  # never sends a heartbeat
        verdict = server.verdicts.get(timeout=10)
        assert verdict.stack == dump and verdict.stuck == where_stuck(dump)
        assert verdict.stuck is not None and verdict.stuck.caller == "train.py:40 in step"
    finally:
        server.stop()


def test_a_stopped_rank_is_not_asked_for_stacks_and_its_verdict_does_not_wait(
    tmp_path: Path, in_process_client
):
    """A stopped process (SIGSTOP) could never dump: the capture is not asked to wait for it
    (a fake capture that would block), and the verdict says why it has no stacks."""
    asked: list[list[tuple[int, Path]]] = []

    def capture(targets, sig, timeout):
        asked.append(targets)
        if targets:
            time.sleep(30)  # what waiting for a stopped process would cost (its timeout)
        return {}

    config = RankMonitorConfig(initial_rank_heartbeat_timeout=0.3, stack_capture_timeout=30.0)
    server = RankMonitorServer(config, job_dir=tmp_path / "job", capture=capture,
                               status=lambda pid: "stopped").start()  # fmt: skip
    try:
        in_process_client(server, 0)
        verdict = server.verdicts.get(timeout=10)
        assert asked == [[]] and verdict.stopped and verdict.stack_file is None
        assert verdict.detected_at - verdict.deadline < 1.0
        assert "the process is stopped" in verdict.describe()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("status", "stopped", "answers"),
    [("stopped", True, False), ("tracing-stop", True, False), ("sleeping", False, True),
     ("running", False, True), ("zombie", False, False), (None, False, False)],
)  # fmt: skip
def test_which_process_states_can_act(status: str | None, stopped: bool, answers: bool) -> None:
    assert (cannot_act(status), can_answer(status)) == (stopped, answers)
