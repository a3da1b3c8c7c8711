"""The one termination routine (`agent.termination`) on real processes: whole groups, a grace
period then SIGKILL, SIGKILL at once, bounded waits, and no exit status stolen from a Popen."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from ftrun.agent.node_services.health import _run_command
from ftrun.agent.termination import (
    Delivery,
    kill_at_once,
    kill_group_now,
    terminate,
    wait_reaped,
)
from ftrun.errors import NodeUnhealthyError
from support import wait_for

pytestmark = pytest.mark.process

IGNORES_TERM = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print('ready', flush=True); time.sleep(60)"
)
ENDS_ON_TERM = "import time; print('ready', flush=True); time.sleep(60)"


def others(proc: subprocess.Popen[str]) -> frozenset[int]:
    """This process's other children (under xdist, a Slurm daemon re-parented here, say): the
    agent takes its direct children that lead no worker group for orphans to stop."""
    return frozenset(p.pid for p in psutil.Process().children() if p.pid != proc.pid)


def start(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    with proc.stdout:  # it prints nothing more
        assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_group_that_ends_on_sigterm_is_not_sigkilled_and_keeps_its_status() -> None:
    proc = start(ENDS_ON_TERM)
    result = terminate([proc.pid], Delivery.graceful(signal.SIGTERM, 10.0), others(proc))
    assert (result.killed, result.survivors) == (0, 0) and result.duration < 5
    assert proc.wait(5) == -signal.SIGTERM  # the Popen still gets the status


def test_a_draining_stop_lets_a_process_leaving_on_its_own_finish_unsignalled() -> None:
    """A rank exiting 16 once its part of a re-run's checkpoint is saved: not killed mid-save."""
    proc = start("import sys, time; print('ready', flush=True); time.sleep(0.5); sys.exit(16)")
    delivery = Delivery.graceful(signal.SIGTERM, 10.0, drain=True)
    assert delivery.drain == 10.0 and Delivery.graceful(signal.SIGTERM, 10.0).drain == 0.0
    result = terminate([proc.pid], delivery, others(proc))
    assert (result.killed, result.survivors) == (0, 0) and result.duration < 5
    assert proc.wait(5) == 16


def test_a_drain_is_bounded_then_the_signal_goes() -> None:
    proc = start(ENDS_ON_TERM)
    result = terminate([proc.pid], Delivery.graceful(signal.SIGTERM, 0.5, drain=True),
                       others(proc))  # fmt: skip
    assert 0.5 <= result.duration < 5 and result.killed == 0
    assert proc.wait(5) == -signal.SIGTERM


def test_a_group_ignoring_sigterm_gets_sigkill_after_the_grace_period_children_included() -> None:
    proc = start(IGNORES_TERM)
    started = time.monotonic()
    result = terminate([proc.pid], Delivery.graceful(signal.SIGTERM, 0.5), others(proc))
    assert time.monotonic() - started >= 0.5
    assert result.killed == 2 and result.survivors == 0  # the leader and its child
    assert proc.wait(5) == -signal.SIGKILL


def test_sigkill_first_does_not_wait_out_the_grace_period() -> None:
    """--ft-rank-termination-signal=SIGKILL: the grace is a bound, not a pause."""
    proc = start(IGNORES_TERM)
    result = terminate([proc.pid], Delivery.graceful(signal.SIGKILL, 30.0), others(proc))
    assert result.survivors == 0 and result.duration < 5
    assert proc.wait(5) == -signal.SIGKILL


def test_a_stopped_group_gets_sigkill_at_once_not_after_the_grace_period() -> None:
    # NVRx's examples simulate a hung rank with SIGSTOP: it acts on no SIGTERM, ever.
    proc = start(IGNORES_TERM)
    child = psutil.Process(proc.pid).children()[0]
    proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 10, "stopped")
    result = terminate([proc.pid], Delivery.graceful(signal.SIGTERM, 30.0), others(proc))
    assert result.duration < 5 and (result.stopped, result.killed, result.survivors) == (1, 0, 0)
    assert proc.wait(5) == -signal.SIGKILL
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE  # its group too


def test_who_is_killed_at_once_a_stopped_leader_with_its_group_a_stopped_child_alone() -> None:
    statuses = {1: "stopped", 2: "sleeping", 3: "tracing-stop", 4: None, 5: "zombie"}
    assert kill_at_once([1, 2], statuses) == ([1], [3])
    assert kill_at_once([2], {2: "running", 6: "disk-sleep"}) == ([], [])


def test_kill_group_now_and_a_bounded_reap() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)  # fmt: skip
    assert wait_reaped(proc.pid, 0.2) is None  # still running at the deadline
    kill_group_now(proc.pid)
    assert wait_reaped(proc.pid, 10) == -signal.SIGKILL
    kill_group_now(proc.pid)  # gone: not an error
    proc.returncode = -signal.SIGKILL  # reaped above: tell the Popen, so it does not wait


def test_a_timed_out_health_command_is_killed_with_its_group_only() -> None:
    """The agent's other children (the fork server) are not the command's: they stay."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(NodeUnhealthyError, match=r"timed out after 0\.3s"):
            _run_command("sleep 30 & sleep 30", 0.3)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(10)
