"""What the re-run state machine costs a training step when nothing is rejected, and how long
from a rejected result to its verdict, in each of the three cases.

1. In this process (CPU, no process group): `validate_result` on a 0-dim loss, the calls a
   step makes (`should_run_forward_backward` twice, `should_checkpoint_and_exit`), and the
   floor (`torch.isnan(loss)` and `bool()` of it alone). Target: validate_result <= 2 us.
2. With real launchers (tests/workers/rerun_worker.py, 2 nodes x 2 gloo ranks and a standby,
   the tests' job harness): a one-off flip (transient: re-run in place), a flip on one node
   (persistent: checkpoint, exit 16, the standby re-runs the step) and a flip everywhere
   (correct, fatal: exit 17). From the rejected step's start (the rank's previous progress
   line) to the `rerun_verdict` event, and to every launcher's exit for the fatal case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import ROOT, smoke
from bench.common.harness import start_job
from bench.common.timing import per_call_us
from ftrun.rerun import RerunDataIterator, RerunMode, RerunStateMachine

WORKER = ROOT / "tests" / "workers" / "rerun_worker.py"
JOB = ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-conf=last_call_timeout=5"]


def us_per_call(fn: Callable[[], Any], calls: int, batches: int = 20) -> float:
    return statistics.median(per_call_us(fn, batches, max(1, calls // batches)))


def in_process(calls: int) -> list[str]:
    rsm = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    data = RerunDataIterator(iter(lambda: torch.ones(1), None))
    loss = torch.tensor(1.5)
    rsm.should_run_forward_backward(data)
    rsm.first_iteration_complete = True

    def step() -> None:
        while rsm.should_run_forward_backward(data):
            next(data)
        rsm.should_checkpoint_and_exit()

    rows = [
        ("validate_result(loss, torch.isnan, ...)", us_per_call(
            lambda: rsm.validate_result(loss, torch.isnan, "loss is NaN"), calls)),
        ("floor: bool(torch.isnan(loss))", us_per_call(lambda: bool(torch.isnan(loss)), calls)),
        ("a step's own calls (2 x should_run_forward_backward, should_checkpoint_and_exit)",
         us_per_call(step, calls // 4)),
    ]  # fmt: skip
    return [f"| {name} | {us:.2f} |" for name, us in rows]


def one_job(mode: str, *extra: str) -> tuple[float, float | None]:
    """(seconds from the rejected step's start to the verdict, to every launcher's exit)."""
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-rerun-") as tmp:
        job = start_job(Path(tmp), 3, JOB, ["--flip", f"{mode}:20", "--steps", "30", *extra],
                        script=WORKER)  # fmt: skip
        try:
            job.wait_event("rendezvous_done", 2)
            first = next(e["nodes"] for e in job.events("rendezvous_done"))
            hosts = {e["node"] for e in job.events("rendezvous_done") if e.get("store_host")}
            victim = next(n for n in first if n not in hosts)
            rank = 2 * first.index(victim) + 1
            job.ckpt_dir.mkdir(parents=True, exist_ok=True)
            (job.ckpt_dir / "flip-rank").write_text(str(rank))
            (job.ckpt_dir / f"fail-{victim}").write_text("")
            job.wait(120)
        finally:
            job.kill()
        rows = (job.ckpt_dir / f"progress-rank{rank}.txt").read_text().splitlines()
        began = float(next(r.split()[4] for r in rows if r.split()[:2] == ["0", "19"]))
        verdict = job.events("rerun_verdict")[0]["ts"]
        ended = max(e["ts"] for e in job.events("exit"))
        return verdict - began, ended - began


def jobs(runs: int, cases_run: int) -> list[str]:
    cases = [("transient (re-run in place)", ("once",)),
             ("persistent (exit 16, re-run on the standby)", ("marked",)),
             ("correct, fatal (exit 16, re-run, exit 17)", ("always", "--fatal"))]  # fmt: skip
    cases = cases[:cases_run]
    times: dict[str, list[tuple[float, float | None]]] = {name: [] for name, _ in cases}
    for _ in range(runs):  # interleaved
        for name, (mode, *extra) in cases:
            times[name].append(one_job(mode, *extra))
    lines = []
    for name, got in times.items():
        verdicts = sorted(v for v, _ in got)
        ends = sorted(e for _, e in got if e is not None)
        lines.append(f"| {name} | {statistics.median(verdicts):.2f} ({verdicts[0]:.2f}-"
                     f"{verdicts[-1]:.2f}) | {statistics.median(ends):.2f} |")  # fmt: skip
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each job case")
    parser.add_argument("--calls", type=int, default=20000, help="in-process calls per figure")
    parser.add_argument("--cases", type=int, default=3, help="job cases run (0: none)")
    args = smoke.parse_args(parser, {"runs": 1, "calls": 200, "cases": 0})
    print("| on the training path (CPU, one process) | us per call (median) |")
    print("|---|---|")
    print("\n".join(in_process(args.calls)))
    if not args.cases:
        return 0
    print()
    print("| case | rejected step -> verdict (s) | -> job over (s) |")
    print("|---|---|---|")
    print("\n".join(jobs(args.runs, args.cases)))
    print(f"\nmedian (min-max) of {args.runs} runs per case, interleaved; the job's 30 steps of "
          "0.05 s, the flip at step 20")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
