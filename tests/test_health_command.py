"""The health command (`agent.node_services.health._run_command`) on real processes: a process
it starts in a session of its own (out of reach of the group kill) holds the command's output
open, and the agent's check still returns on time."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ftrun.agent.node_services.health import _run_command
from ftrun.errors import NodeUnhealthyError
from support import reap_zombies, wait_for

pytestmark = pytest.mark.process

BOUND_S = 3.0
"""What the check may take beyond the command's timeout: the group kill and a bounded reap."""


@pytest.fixture
def escaped(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A shell line that starts `sleep 60` in a new session, holding the command's stdout, and
    writes its pid to a file; the fixture kills it at the end and checks it is gone."""
    pid_file = tmp_path / "escaped.pid"
    yield f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 60' &", pid_file
    pid = wait_for(lambda: read_pid(pid_file), 10, "the escaped child's pid")
    wait_for(lambda: _name(pid) == "sleep", 10, "the escaped child to be sleep")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _name(pid) is None, 10, "the escaped child to go")
    reap_zombies()  # it re-parented to the test process (a subreaper): collect it
    assert not psutil.pid_exists(pid)


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return int(text) if text.endswith("\n") else None


def _name(pid: int) -> str | None:
    """The process's name while it runs; None once it is gone or a zombie."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.name()
    except psutil.NoSuchProcess:
        return None


def run_bounded(command: str, timeout: float) -> tuple[BaseException | None, float]:
    """`_run_command` in a thread joined with a deadline: a hang fails the test, not the suite
    (the fixture's kill of the escaped child then lets the thread end)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            _run_command(command, timeout)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name="health-command", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(timeout + BOUND_S)
    took = time.monotonic() - started
    assert not thread.is_alive(), f"the health check still waits after {took:.1f}s"
    return (raised[0] if raised else None), took


def test_a_hung_command_whose_child_left_its_group_times_out_on_time(escaped):
    line, pid_file = escaped
    error, took = run_bounded(f"{line} echo started; sleep 30", 0.5)
    assert isinstance(error, NodeUnhealthyError) and "timed out after 0.5s" in str(error)
    assert 0.5 <= took < 0.5 + BOUND_S
    pid = wait_for(lambda: read_pid(pid_file), 10, "the escaped child's pid")
    assert _name(pid) == "sleep"  # out of the group's reach: the agent went on without it


def test_a_command_that_ends_at_once_passes_at_once_though_its_child_holds_the_output(escaped):
    line, _ = escaped
    error, took = run_bounded(f"{line} echo fine", 5.0)
    assert error is None and took < 2.0


def test_a_failing_command_says_its_last_line(escaped):
    line, _ = escaped
    error, _ = run_bounded(f"{line} echo first; echo sick; exit 3", 5.0)
    assert isinstance(error, NodeUnhealthyError)
    assert str(error) == "health command exited 3: sick"
