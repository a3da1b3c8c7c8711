"""`make demo` end to end: a crash and a hang recovered, a node lost and replaced by the spare
with its ranks restored from replicas, the report with the hang's likely cause."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_demo_recovers_and_reports_the_hung_rank(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    cmd = [sys.executable, str(DEMO)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=360, env=env, check=False)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "training finished: True" in out and f"-{int(signal.SIGKILL)}" in out
    assert "standby" in out and "losing node" in out
    restores = [line for line in out.splitlines() if "ckpt_restore" in line]
    assert any("'fetched': 0" not in line and "'iteration': -1" not in line for line in restores)
    assert "Outcome    SUCCESS" in out
    assert "CRASH: rank 1 on node" in out
    # rank 2 sleeps in its own code; its peers wait for it inside torch
    assert "at train_ddp.py:" in out and "in hang_in_step  <- likely the cause" in out, out
    assert "waiting inside torch/" in out
    (work,) = tmp_path.glob("ftrun-demo-*")
    assert (work / "timeline.png").read_bytes().startswith(b"\x89PNG")
