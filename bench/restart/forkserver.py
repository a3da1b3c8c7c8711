"""Fork server vs plain spawn: time to a torch worker's first line, and memory (PSS).

The worker script imports the prewarm modules (torch...), prints one line, sleeps. Measured,
interleaved run by run:

- plain: `python -u worker.py` (Popen, as the agent spawns today): spawn call -> first line;
- forked: `ForkServer.spawn` from a warm server (imports done): spawn call -> first line;
- start-up, N workers at once: plain N spawns vs `ForkServer.start` + N spawns, first call ->
  last worker's first line (the server imports once, not once per rank);
- PSS (psutil memory_full_info().pss) of N live plain workers vs server + N forked workers.

Run: .venv/bin/python -m bench.restart.forkserver [--runs 5] [--workers 2] [--modules torch,...]
[--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from bench.common import smoke
from bench.common.timing import Stopwatch
from ftrun.agent.prewarm.client import ForkServer
from ftrun.agent.prewarm.target import PythonTarget

WORKER = """\
import time
{imports}
x = torch.ones(1000).sum()
print("up", flush=True)
time.sleep(600)
"""


def first_line(stream, timeout: float = 120.0) -> None:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, "worker printed nothing"
    assert stream.readline() == b"up\n"


def plain(script: str, env: dict[str, str], n: int) -> tuple[float, list[subprocess.Popen]]:
    started = Stopwatch()
    procs = [
        subprocess.Popen(
            [sys.executable, "-u", script],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for _ in range(n)
    ]
    for proc in procs:
        first_line(proc.stdout)
    return started.seconds(), procs


def forked(fs: ForkServer, script: str, env: dict[str, str], n: int) -> tuple[float, list]:
    started = Stopwatch()
    workers = [fs.spawn(PythonTarget(False, script, ()), env, "/") for _ in range(n)]
    for worker in workers:
        first_line(worker.stdout)
    return started.seconds(), workers


def pss(pids: list[int]) -> tuple[float, float]:
    """Sum of PSS and of USS over `pids`, MiB."""
    infos = [psutil.Process(pid).memory_full_info() for pid in pids]
    return sum(i.pss for i in infos) / 2**20, sum(i.uss for i in infos) / 2**20


def stop(handles: list) -> None:
    for handle in handles:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pid, 9)
        handle.wait(30)
        handle.stdout.close()
        handle.stderr.close()


def fmt(values: list[float], scale: float = 1.0, unit: str = "s") -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):8.3f} {unit} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--modules", default="torch,torch.distributed,torch._dynamo")
    opts = smoke.parse_args(parser, {"runs": 1, "workers": 1, "modules": "torch"})
    modules = [m for m in opts.modules.split(",") if m]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's default with several workers
    n = opts.workers
    with tempfile.TemporaryDirectory() as tmp:
        script = str(Path(tmp) / "worker.py")
        Path(script).write_text(WORKER.format(imports="\n".join(f"import {m}" for m in modules)))
        results: dict[str, list[float]] = {k: [] for k in ("plain1", "fork1", "plainN", "forkN")}
        mem: dict[str, list[tuple[float, float]]] = {"plain": [], "fork": []}
        ready_s: list[float] = []
        for run in range(opts.runs):
            # start-up: N plain workers at once vs a fresh server + N forks
            took, procs = plain(script, env, n)
            results["plainN"].append(took)
            mem["plain"].append(pss([p.pid for p in procs]))
            stop(procs)
            started = Stopwatch()
            fs = ForkServer.start(modules, env)
            try:
                assert fs.ready(300), fs.error
                ready_s.append(started.seconds())
                _, workers = forked(fs, script, env, n)
                results["forkN"].append(started.seconds())
                mem["fork"].append(pss([fs.pid, *(w.pid for w in workers)]))
                stop(workers)
                # one restart of one worker: warm server vs plain spawn
                took, workers = forked(fs, script, env, 1)
                results["fork1"].append(took)
                stop(workers)
            finally:
                fs.close()
            took, procs = plain(script, env, 1)
            results["plain1"].append(took)
            stop(procs)
            print(f"run {run + 1}/{opts.runs} done", file=sys.stderr)
    cpu = os.cpu_count()
    print(f"{cpu} CPUs, python {sys.version.split()[0]}, prewarm {modules}, {opts.runs} runs")
    print(f"server ready after start (imports) : {fmt(ready_s)}")
    print(f"1 worker, plain spawn -> first line: {fmt(results['plain1'])}")
    print(f"1 worker, warm fork   -> first line: {fmt(results['fork1'], 1000, 'ms')}")
    print(f"{n} workers at start-up, plain      : {fmt(results['plainN'])}")
    print(f"{n} workers at start-up, fork server: {fmt(results['forkN'])}  (incl. imports)")
    for kind, label in (("plain", f"{n} plain workers"), ("fork", f"server + {n} forked")):
        pss_mib = [p for p, _ in mem[kind]]
        uss_mib = [u for _, u in mem[kind]]
        print(f"PSS {label:20}: {fmt(pss_mib, unit='MiB')}   USS {fmt(uss_mib, unit='MiB')}")


if __name__ == "__main__":
    main()
