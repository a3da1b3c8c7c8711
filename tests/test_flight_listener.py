"""The worker's flight-recorder listener and the agent's request, without a launcher: a rank
answers at once, with torch's JSON or with why it has none, so the agent never waits out its
bound for a rank that cannot dump."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ftrun.agent.loop.flight_recorder import DUMP_TIMEOUT_S, FlightRecorder, _await_dumps
from ftrun.client_lib.flight import fifo_path
from ftrun.rank_monitor.process_state import is_stopped
from support import wait_for

NO_TORCH = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ftrun.client_lib import flight
    assert flight.start_listener(Path(sys.argv[1]), 3) is not None
    assert "torch" not in sys.modules
    print("listening", flush=True)
    time.sleep(60)
    """
)


def test_a_rank_without_torch_answers_at_once_and_is_skipped(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir(mode=0o700)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "10"}
    with subprocess.Popen([sys.executable, "-c", NO_TORCH, str(job_dir)], env=env,
                          stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
            wait_for(lambda: fifo_path(job_dir, 3, proc.pid).exists(), 10, "the rank's FIFO")
            recorder = FlightRecorder(job_dir, tmp_path / "logs", "n0", lambda *a, **k: None)
            started = time.monotonic()
            recorder._dump(0, [(3, proc.pid)])  # the request, alone
            assert time.monotonic() - started < DUMP_TIMEOUT_S / 2
            assert recorder._dumped[0] == []
            kept = (tmp_path / "logs" / "cycle0" / "flight-rank3.json").read_text()
            assert "torch is not imported" in kept
        finally:
            proc.kill()


def test_a_rank_with_no_listener_is_not_waited_for(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path, tmp_path / "logs", "n0", lambda *a, **k: None)
    started = time.monotonic()
    recorder._dump(0, [(0, 999_999)])
    assert time.monotonic() - started < DUMP_TIMEOUT_S / 2  # not its wait for an answer


def test_a_stopped_rank_is_not_asked_and_a_rank_that_dies_is_not_waited_for(
    tmp_path: Path,
) -> None:
    """A stopped rank (SIGSTOP) holds its FIFO open but can never answer; a rank that dies after
    the request (its collective's peer was killed) never will either: neither costs the bound."""
    job_dir = tmp_path / "job"
    job_dir.mkdir(mode=0o700)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "10"}
    recorder = FlightRecorder(job_dir, tmp_path / "logs", "n0", lambda *a, **k: None)
    with subprocess.Popen([sys.executable, "-c", NO_TORCH, str(job_dir)], env=env,
                          stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
            wait_for(lambda: fifo_path(job_dir, 3, proc.pid).exists(), 10, "the rank's FIFO")
            proc.send_signal(signal.SIGSTOP)
            wait_for(lambda: is_stopped(proc.pid), 10, "the rank stopped")
            started = time.monotonic()
            recorder._dump(0, [(3, proc.pid)])
            assert time.monotonic() - started < DUMP_TIMEOUT_S / 2
            assert recorder._dumped[0] == [] and not (tmp_path / "logs").exists()
        finally:
            proc.kill()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"]) as proc:
        started = time.monotonic()
        _await_dumps([(proc.pid, tmp_path / "never-written.json")], DUMP_TIMEOUT_S)
        assert time.monotonic() - started < DUMP_TIMEOUT_S / 2
