"""Effective training time under failures: three ways to checkpoint, each at its best interval.

A plain training (`bench/workers/ettr_worker.py`: 2 launchers x 2 gloo ranks, `--state-mib` of
state per rank, one all_reduce and `--step-sleep` s per step) runs for `--duration` seconds while
the bench SIGKILLs one worker every `--mtbf` seconds (ranks in turn; a kill waits until that rank
has stepped since the last one, so every failure hits a training job). Three settings:

- torchrun + torch.save: a global checkpoint (every rank's shard, fsync, a barrier, `latest`);
- NVRx + sync local saves: NVRx's ft_launcher, each rank's shard torch.saved to a node-local
  directory, a restart resumes from the newest step every rank holds;
- ft_launcher + ftrun: `LocalCheckpointManager.save(is_async=True)` into node memory, and every
  10th save also `GlobalCheckpointManager.save` (DCP, async) to the shared directory; a restart
  takes the newest of both with `restore`, read straight into the state.

Each setting first runs `--calibrate` seconds without failures to measure its save stall and its
step time, then checkpoints every K steps, K from Young's formula: the interval sqrt(2 x stall x
MTBF) minimises stall time plus expected work redone. ETTR = progress x step time / wall time,
where progress is the newest step rank 0 finished by the end and the step time is the median of
the steps without a save (measured in the same run). Start-up counts as lost, as in a real job.

    .venv/bin/python -m bench.checkpoint.ettr [--duration 120] [--mtbf 30] [--runs 1] [--markdown]
        [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import WORKERS, smoke
from bench.common.jobs import FT, NVRX, TORCHRUN_NO_SHARE, WORLD, Job, Launcher, job, take_charge
from bench.common.logs import Line, read_lines, steady_stalls
from bench.common.report import Stats, load_average, machine_line, progress, table

WORKER = WORKERS / "ettr_worker.py"
CALIBRATION_SAVE_EVERY = 10
MIN_CALIBRATION_SAVES = 4
KILL_WAIT_S = 60.0
GLOBAL_EVERY = 10  # local saves per global one: the durable copy, for what node memory loses


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    launcher: Launcher
    save: str
    worker_extra: tuple[str, ...] = ()


SETTINGS = (
    Setting("torchrun + torch.save (global)", TORCHRUN_NO_SHARE, "torch"),
    Setting("NVRx + sync local saves", NVRX, "local-sync"),
    Setting(
        f"ft_launcher + ftrun async local + async global (every {GLOBAL_EVERY}th)",
        FT,
        "ftrun",
        ("--global-every", str(GLOBAL_EVERY)),
    ),
)


def step_time(lines: Sequence[Line]) -> float | None:
    """Median gap between consecutive steps of one process with no save or restore between."""
    gaps = [
        b.ts - a.ts
        for a, b in itertools.pairwise(lines)
        if a.kind == b.kind == "step" and a.pid == b.pid and b.step == a.step + 1
    ]
    return statistics.median(gaps) if gaps else None


def worker_args(args: argparse.Namespace, setting: Setting, ckpt: Path, every: int) -> list[str]:
    return [
        "--ckpt-dir", str(ckpt), "--save", setting.save, "--save-every", str(every),
        "--state-mib", str(args.state_mib), "--step-sleep", str(args.step_sleep),
        *setting.worker_extra,
    ]  # fmt: skip


def _job(
    setting: Setting, args: argparse.Namespace, every: int, name: str, extra: Sequence[str]
) -> tuple[Path, contextlib.AbstractContextManager[Job]]:
    """A job of `setting`, not started until entered, and its checkpoint directory."""
    ckpt = Path(tempfile.mkdtemp(prefix=f"ftrun-ettr-{name}-"))
    return ckpt, job(setting.launcher, extra, worker_args(args, setting, ckpt, every), WORKER)


@dataclasses.dataclass(frozen=True)
class Calibration:
    stall_s: float
    step_s: float
    every: int


def calibrate(setting: Setting, args: argparse.Namespace) -> Calibration | None:
    ckpt, context = _job(setting, args, CALIBRATION_SAVE_EVERY, "calibrate", ("--max-restarts=0",))
    try:
        with context as run:
            enough = run.wait(
                lambda: (
                    True
                    if len(steady_stalls(read_lines(run.out, 0))) >= MIN_CALIBRATION_SAVES
                    else None
                ),
                args.calibrate,
            )
            lines = read_lines(run.out, 0)
            if not enough:
                progress(f"  {setting.name}: calibration incomplete; {run.describe()}")
                return None
    finally:
        _remove(ckpt)
    stall, step = statistics.median(steady_stalls(lines)), step_time(lines)
    if step is None:
        return None
    every = max(1, round(math.sqrt(2 * stall * args.mtbf) / step))
    return Calibration(stall, step, every)


@dataclasses.dataclass(frozen=True)
class Outcome:
    ettr: float
    final_step: int
    failures: int
    stall_s: float
    step_s: float


def kill_rank(run: Job, rank: int, since: float) -> bool:
    """SIGKILL `rank`'s worker once it has stepped after `since`; False if it never did."""

    def target() -> int | None:
        lines = [x for x in read_lines(run.out, rank) if x.kind == "step" and x.ts > since]
        return lines[-1].pid if lines else None

    pid = run.wait(target, KILL_WAIT_S)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def measured_run(setting: Setting, args: argparse.Namespace, cal: Calibration) -> Outcome | None:
    ckpt, context = _job(setting, args, cal.every, "run", ("--max-restarts=1000",))
    try:
        with context as run:
            failures, last_kill = 0, 0.0
            end = run.launched_at + args.duration
            while time.time() < end and run.running():
                due = run.launched_at + args.mtbf * (failures + 1)
                if time.time() < due:
                    time.sleep(min(0.05, max(due - time.time(), 0)))
                    continue
                if due >= end:
                    time.sleep(max(end - time.time(), 0))
                    break
                if kill_rank(run, (failures + 1) % WORLD, last_kill):
                    failures += 1
                    last_kill = time.time()
                else:
                    progress(f"  {setting.name}: no rank to kill; {run.describe()}")
                    return None
            lines = read_lines(run.out, 0)
    finally:
        _remove(ckpt)
    done = [x.step for x in lines if x.kind == "step" and x.ts <= end]
    step = step_time(lines)
    if not done or step is None:
        return None
    stalls = [x.seconds for x in lines if x.kind == "save"]
    final = max(done)
    ettr = final * cal.step_s / args.duration
    return Outcome(ettr, final, failures, statistics.median(stalls) if stalls else 0.0, step)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="s per measured run")
    parser.add_argument("--mtbf", type=float, default=30.0, help="s between injected failures")
    parser.add_argument("--calibrate", type=float, default=60.0, help="max s to calibrate")
    parser.add_argument("--state-mib", type=int, default=256, help="per-rank state")
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--only", choices=[s.save for s in SETTINGS], action="append")
    parser.add_argument("--markdown", action="store_true")
    sizes = {"duration": 8.0, "mtbf": 4.0, "calibrate": 5.0, "state_mib": 4, "runs": 1}
    args = smoke.parse_args(parser, sizes)
    if args.duration <= args.mtbf or args.mtbf <= 0 or args.runs < 1 or args.state_mib < 1:
        parser.error("need duration > mtbf > 0, runs >= 1, state-mib >= 1")
    return args


def main() -> None:
    args = parse_args()
    take_charge()
    load_before = load_average()
    settings = [s for s in SETTINGS if not args.only or s.save in args.only]
    settings = [s for s in settings if s.launcher.available or progress(f"skip {s.name}")]
    calibrations = {}
    for setting in settings:
        progress(f"calibrating {setting.name}")
        calibrations[setting.name] = calibrate(setting, args)
        progress(f"  {calibrations[setting.name]}")
    results: dict[str, list[Outcome]] = {s.name: [] for s in settings}
    for run_index in range(args.runs):
        for setting in settings:  # interleaved, so a busy minute hits every setting alike
            cal = calibrations[setting.name]
            if cal is None:
                continue
            progress(f"run {run_index + 1}/{args.runs}: {setting.name}, save every {cal.every}")
            outcome = measured_run(setting, args, cal)
            progress(f"  {outcome}")
            if outcome is not None:
                results[setting.name].append(outcome)
    print(render(settings, calibrations, results, args))
    print(machine_line(load_before))


def render(settings, calibrations, results, args) -> str:
    rows = []
    for setting in settings:
        cal, outs = calibrations[setting.name], results[setting.name]
        if cal is None or not outs:
            rows.append([setting.name, "failed", "", "", "", "", ""])
            continue
        ettr = Stats.of([o.ettr for o in outs])
        rows.append([
            setting.name,
            f"{cal.stall_s:.3f}",
            f"{cal.every} ({cal.every * cal.step_s:.1f} s)",
            str(statistics.median(o.failures for o in outs)),
            str(statistics.median(o.final_step for o in outs)),
            ettr.cell("{:.1%}") if ettr else "",
            f"{cal.step_s * 1000:.1f}",
        ])  # fmt: skip
    headers = [
        "setting", "save stall s", "save every (steps)", "failures", "final step", "ETTR",
        "step ms",
    ]  # fmt: skip
    caption = (
        f"{args.duration:.0f} s runs, a worker SIGKILLed every {args.mtbf:.0f} s, "
        f"{args.state_mib} MiB per rank, 2 launchers x 2 ranks, {args.runs} run(s)"
    )
    return caption + "\n" + table(headers, rows, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
