"""A pre-started worker process: imports the heavy modules now, runs the training script later.

The agent keeps one spare per local rank. On a restart it hands each spare its command line and
environment (one JSON line on stdin), and the new worker skips the seconds that importing torch
takes. The spare is an ordinary fresh process (not a fork), started like any worker: its own
process group, killed with the agent. Run as `python -u -m ftrun.agent.spare MODULE...`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import sys


def main() -> None:
    for module in sys.argv[1:]:
        with contextlib.suppress(Exception):  # the script will report a broken import itself
            importlib.import_module(module)
    line = sys.stdin.readline()
    if not line:
        return  # the agent no longer needs this spare
    job = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # workers get no stdin, as when spawned directly
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    target, args = job["target"], job["args"]
    if job["module"]:
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
