"""The worker's flight-recorder listener and the agent's request, without a launcher: a rank
answers at once, with torch's JSON or with why it has none, so the agent never waits out its
bound for a rank that cannot dump."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ftrun.agent.flight_recorder import DUMP_TIMEOUT_S, FlightRecorder
from ftrun.client_lib.flight import fifo_path
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
    assert time.monotonic() - started < 0.5
