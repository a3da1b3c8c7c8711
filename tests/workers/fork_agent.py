"""An agent stand-in for tests/test_forked_server.py: set up what an agent has before it starts
its fork server (a root logging handler, a recording SIGTERM handler, an inherited fd), start
the server (forked where it can be), run one worker, and print one JSON line.

fork_agent.py CONFIG   CONFIG is JSON:
  modules     the prewarm modules
  env         variables the server's environment has on top of ours
  target      the worker's script; args: its arguments
  fork        ask for a forked server
  thread      start a thread first (the agent is then not forkable)
  torch       import torch first with the server's environment, then set our C++ log level
              to FATAL, as the launcher does
  then        "report": the worker's exit code and output; "hold": print the server's pid and
              sleep (the test kills us); "kill": SIGKILL the server, tell what the agent saw
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

from ftrun.agent.prewarm import launch
from ftrun.agent.prewarm.client import ForkServer
from ftrun.agent.prewarm.target import PythonTarget

DEADLINE = 60.0


def main() -> None:
    config = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format="agent: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: None)
    os.set_inheritable(os.open(os.devnull, os.O_RDONLY), True)  # a stray fd, as from Slurm
    if config.get("thread"):
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    env = {**os.environ, **config.get("env", {})}
    target = PythonTarget(False, config["target"], ())
    result: dict[str, object] = {}
    if config.get("torch"):
        with launch.environment({**env, "OPENBLAS_NUM_THREADS": "1"}):
            import torch.distributed  # noqa: F401
    server = ForkServer.start(config["modules"], env, target=target, fork=config.get("fork", False))
    if config.get("torch"):
        result["agent_level_set"] = launch.set_cpp_log_level("FATAL")
    with server:
        assert server.ready(DEADLINE), server.error
        result.update(forked=server.forked, server=server.pid, agent=os.getpid())
        getattr(sys.modules[__name__], f"_{config['then']}")(server, config, env, result)
    result["server_code"] = server._proc.returncode
    result["server_reaped"] = not os.path.exists(f"/proc/{server.pid}")
    print(json.dumps(result), flush=True)


def _report(server: ForkServer, config: dict, env: dict, result: dict) -> None:
    target = PythonTarget(False, config["target"], tuple(config.get("args", ())))
    worker = server.spawn(target, env, os.getcwd())
    code = worker.wait(DEADLINE)
    with worker.stdout, worker.stderr:
        result["worker"] = [code, worker.stdout.read().decode(), worker.stderr.read().decode()]


def _hold(server: ForkServer, config: dict, env: dict, result: dict) -> None:
    print(server.pid, flush=True)
    time.sleep(600)


def _kill(server: ForkServer, config: dict, env: dict, result: dict) -> None:
    os.kill(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + DEADLINE
    while server.ready(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    result["error"] = server.error


if __name__ == "__main__":
    main()
