"""A fork server forked from the agent (ftrun.agent.prewarm.launch, inherit): its workers see
what a spawned server's see, it is spawned wherever a fork could not stand in for one, and it
ends, is reaped and dies with the agent like a spawned one. The agent is a stand-in process
(tests/workers/fork_agent.py), so that the test's own threads never reach a fork."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from support import WORKERS, wait_for

pytestmark = pytest.mark.process

AGENT = str(WORKERS / "fork_agent.py")
PROBE = str(WORKERS / "forked_probe.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
DEADLINE = 60.0
# What differs between two workers whatever started them.
OWN = ("pid", "ppid", "pgid", "sid", "random", "torch_seed")


def run_agent(**config: Any) -> tuple[dict[str, Any], str]:
    """The stand-in's JSON line, and its stderr (its log)."""
    config = {"modules": ["email.mime.text"], "target": PROBE, "then": "report", **config}
    done = subprocess.run(
        [sys.executable, AGENT, json.dumps(config)],
        env=ENV, capture_output=True, text=True, timeout=DEADLINE * 2, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def report(result: dict[str, Any]) -> dict[str, Any]:
    code, out, err = result["worker"]
    assert (code, err) == (0, ""), err
    return {k: v for k, v in json.loads(out).items() if k not in OWN}


def test_workers_of_a_forked_server_see_what_a_spawned_servers_see() -> None:
    env = {"PYTHONFAULTHANDLER": "1", "ONLY_WORKERS": "x"}
    forked, log = run_agent(fork=True, env=env, args=["report"])
    spawned, _ = run_agent(fork=False, env=env, args=["report"])
    assert forked["forked"] and not spawned["forked"]
    assert "forked from the agent" in log
    seen = report(forked)
    assert seen == report(spawned)
    # Not the agent's: its SIGTERM handler, root handler, stray fd, buffered stdio. (SIGINT's
    # is Python's own, or ignored where the test runner ignores it: xdist's workers do.)
    assert seen["handlers"][0] == str(signal.SIG_DFL)
    assert seen["handlers"][1] in (str(signal.default_int_handler), str(signal.SIG_IGN))
    assert seen["root_logging"] == [30, 0] and seen["fds"][:3] == [0, 1, 2]
    assert seen["stdio_buffers"] == ["FileIO", "FileIO"] and seen["faulthandler"]
    assert seen["env"]["ONLY_WORKERS"] == "x"
    assert seen["modules"] == ["email.mime.text"]  # imported by the server: the agent had not


def test_a_forked_server_is_reaped_when_killed_and_its_death_seen() -> None:
    result, _ = run_agent(fork=True, then="kill")
    assert result["forked"]
    assert result["error"] and result["server_code"] == -signal.SIGKILL
    assert result["server_reaped"]


def test_a_forked_server_is_reaped_on_close() -> None:
    result, _ = run_agent(fork=True, args=["report"])
    # Its end, as a spawned server's: EOF, then SIGKILL once it closed the socket (exiting).
    assert result["forked"] and result["server_code"] in (0, -signal.SIGKILL)
    assert result["server_reaped"]


def test_a_forked_server_dies_with_the_agent() -> None:
    config = {"modules": ["json"], "target": PROBE, "then": "hold", "fork": True}
    with subprocess.Popen(
        [sys.executable, AGENT, json.dumps(config)], env=ENV, stdout=subprocess.PIPE, text=True
    ) as agent:
        try:
            assert agent.stdout is not None
            server = int(agent.stdout.readline())
            assert psutil.Process(server).ppid() == agent.pid
            assert os.getsid(server) == server  # its own session
        finally:
            agent.kill()
            agent.wait(DEADLINE)
    wait_for(lambda: gone(server), DEADLINE, "the server to die with the agent")


def gone(pid: int) -> bool:
    """Exited (a zombie of ours counts: the test is a subreaper, the server re-parented)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"thread": True}, "threads"),
        ({"env": {"PYTHONHASHSEED": "7"}}, "PYTHONHASHSEED"),
        ({"env": {"OMP_NUM_THREADS": "3"}}, None),  # read at import, not at process start
    ],
)
def test_spawned_where_a_fork_would_not_be_the_same_server(config: dict, why: str | None) -> None:
    result, log = run_agent(fork=True, args=["report", "0"], **config)
    assert result["forked"] == (why is None), log
    if why is not None:
        assert "spawned, not forked" in log and why in log
    assert result["worker"][0] == 0, result["worker"][2]


def test_spawned_where_the_workers_path0_shadows_an_imported_module(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(Path(PROBE).read_text())
    (tmp_path / "json.py").write_text("raise SystemExit('the shadowing json')\n")
    result, log = run_agent(fork=True, target=str(script), args=["report"])
    assert not result["forked"] and "['json']" in log, log


def test_torch_is_inherited_and_the_workers_keep_their_cpp_log_level(tmp_path: Path) -> None:
    """The agent imported torch (with the workers' environment) before the fork and set its
    own C++ log level after it: workers have torch and torch's default level."""
    script = tmp_path / "level.py"
    script.write_text(
        "import ctypes, json, os, sys\n"
        "torch = sys.modules.get('torch')\n"
        "lib = os.path.join(os.path.dirname(torch.__file__), 'lib', 'libc10.so')\n"
        "c10 = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)\n"
        "print(json.dumps(ctypes.c_int.in_dll(c10, 'FLAGS_caffe2_log_level').value))\n"
    )
    result, log = run_agent(fork=True, torch=True, modules=["torch"], target=str(script))
    assert result["forked"] and result["agent_level_set"], log
    code, out, err = result["worker"]
    assert (code, err, out) == (0, "", "1\n")  # c10's default (WARNING), not the agent's FATAL
