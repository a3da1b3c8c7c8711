"""Goodput under a mixed fault schedule: what a fault costs end to end, setting by setting.

One plain script (`bench/workers/goodput_worker.py`: the transformer of the GPU benches, DDP,
AdamW), `--layout` launchers x ranks (2x2; 1x1 on one GPU, where no node can be lost), run
for `--duration` seconds per setting while the bench injects
a fault every `--every` seconds, kinds in turn: an exception, a SIGKILLed rank, a hung rank
(SIGSTOP) and, for settings with a hot spare, a lost node (its launcher's process group
SIGKILLed). A setting without a spare gets a SIGKILLed rank in the lost node's turn. Settings,
side by side in one run, interleaved run by run:

- torchrun + torch.save every `--ckpt-every` steps (hangs end at the script's collective
  timeout, `--pg-timeout`: torchrun has no other hang detection);
- NVRx 0.7's ft_launcher + the same torch.save, or + NVRx's own local checkpoints every
  `--ckpt-every` steps (`nvrx-local`), where NVRx is installed (the device);
- ft_launcher + the same torch.save (ftrun's recovery, the script's checkpoints);
- ft_launcher + `StepSnapshot` every step (and every 5 steps), a spare launcher.

Hangs are detected from heartbeats, for NVRx and ftrun alike: `--hb-timeout` until each life of
the script has made 20 steps, then the timeouts its client computes
(`calculate_and_set_hb_timeouts`).

Goodput = (steps gained in the window) x (the script's own step time) / (the window's length):
the window opens at the first step of the job and lasts `--duration`; the script's own step time
is the median step of the same script without saves, in a job of its own first. Each
fault's lost seconds are split into: detect (the fault to the first worker the launcher
stopped: a process of the job, not the faulted one, ending), recover (to every rank's first step
after the restart), redo (the steps done again, at the script's step time). Stall: the seconds
the steps took beyond the script's own step time, between faults (the saves' stalls and what
their background work takes from training), per fault interval.

    python -m bench.goodput.goodput [--duration 90] [--every 15] [--runs 1] [--device cpu]
        [--settings torchrun,nvrx,ft-torch,ft-snapshot] [--markdown] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from bench.common import WORKERS, smoke
from bench.common.jobs import FT, NVRX, TORCHRUN_NO_SHARE, Job, Launcher, job, take_charge
from bench.common.report import load_average, machine_line, progress, table
from bench.restart.spares import active_non_host

WORKER = WORKERS / "goodput_worker.py"
KINDS = ("raise", "kill", "stop", "node")
# The job's shape, `--layout NxP`: N launchers ("nodes") x P ranks; main() sets it.
LAYOUT = {"nnodes": 2, "nproc": 2}


def world() -> int:
    return LAYOUT["nnodes"] * LAYOUT["nproc"]


def layout_args() -> list[str]:
    return [f"--nnodes={LAYOUT['nnodes']}", f"--nproc-per-node={LAYOUT['nproc']}"]


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str
    name: str
    launcher: Launcher
    save: str
    spare: bool = False
    every: int = 1  # StepSnapshot's


SETTINGS = (
    Setting("torchrun", "torchrun + torch.save", TORCHRUN_NO_SHARE, "torch"),
    Setting("nvrx", "NVRx 0.7 ft_launcher + torch.save", NVRX, "torch"),
    Setting("nvrx-local", "NVRx 0.7 ft_launcher + its local checkpoints", NVRX, "nvrx-local"),
    Setting("ft-torch", "ft_launcher + torch.save", FT, "torch"),
    Setting("ft-snapshot", "ft_launcher + StepSnapshot, a spare", FT, "snapshot", spare=True),
    Setting(
        "ft-snapshot-5",
        "ft_launcher + StepSnapshot every 5, a spare",
        FT,
        "snapshot",
        spare=True,
        every=5,
    ),
)


def settings(args: argparse.Namespace) -> list[Setting]:
    """The settings asked for whose launcher is installed (NVRx: on the device)."""
    return [s for s in SETTINGS if s.key in args.settings.split(",") and s.launcher.available]


@dataclasses.dataclass
class Fault:
    kind: str
    at: float
    rank: int
    before: int = 0  # the newest step any rank had logged when it fired
    detect: float | None = None
    recover: float | None = None
    redone: int | None = None


@dataclasses.dataclass
class Lines:
    """Every rank's log lines so far: (ts, pid, key, value)."""

    rows: list[tuple[float, int, str, float]] = dataclasses.field(default_factory=list)

    @classmethod
    def read(cls, out: Path) -> Lines:
        rows = []
        for rank in range(world()):
            path = out / f"rank{rank}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            for line in text.split("\n")[:-1]:
                fields = line.split()
                values = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
                for key in ("step", "save", "from"):
                    if key in values:
                        rows.append((float(fields[0]), int(values["pid"]), key, float(values[key])))
        return cls(sorted(rows))

    def newest_step(self, until: float = float("inf")) -> int:
        return int(max((v for ts, _, k, v in self.rows if k == "step" and ts <= until), default=0))

    def pids(self, until: float) -> set[int]:
        return {pid for ts, pid, _, _ in self.rows if ts <= until}


class Exits:
    """When each process of the job was first seen and when it ended, by polling its launchers'
    descendants."""

    def __init__(self, run: Job) -> None:
        self._run, self.ended, self.seen = run, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            now, alive = time.time(), set()
            for proc in self._run.procs:
                try:
                    alive |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
                except psutil.Error:
                    continue
            for pid in self.seen.keys() - alive:
                self.ended.setdefault(pid, now)
            for pid in alive:
                self.seen.setdefault(pid, now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def fire(run: Job, fault: Fault) -> set[int]:
    """Inject `fault`; the pids it ends itself (not the launcher's detection)."""
    target = _pid_of_rank(run, fault.rank)
    if fault.kind == "raise":
        (run.out / f"raise-rank{fault.rank}").touch()
        return {target} if target else set()
    if fault.kind in ("kill", "stop") and target:
        os.kill(target, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        return {target} if fault.kind == "kill" else set()
    return _lose_a_node(run) if fault.kind == "node" else set()


def _pid_of_rank(run: Job, rank: int) -> int | None:
    """The process that logged the rank's newest line, if it is alive."""
    path = run.out / f"rank{rank}.log"
    lines = path.read_text(errors="replace").split("\n")[:-1] if path.exists() else []
    for line in reversed(lines):
        if "pid=" in line:
            pid = int(line.split("pid=")[1].split()[0])
            return pid if psutil.pid_exists(pid) else None
    return None


def _lose_a_node(run: Job) -> set[int]:
    """SIGKILL the process group of a launcher that runs ranks and does not host the store (as
    bench/restart/spares.py loses one); the pids it ended."""
    victim = active_non_host(run, Lines.read(run.out).pids(float("inf")))
    if victim is None:
        return set()
    ended = {victim.pid, *(p.pid for p in victim.children(recursive=True))}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(victim.pid, signal.SIGKILL)
    return ended


def one_run(setting: Setting, args: argparse.Namespace) -> tuple[float, list[Fault], float]:
    """(goodput at `args.step_s`, the faults, the save stall per fault interval)."""
    # Every fault is a restart: the budget must outlast the schedule (the last flag wins).
    extra = [*layout_args(), "--max-restarts=1000", *(setting.launcher.hang_args or ())]
    if setting.launcher is not TORCHRUN_NO_SHARE:
        extra.append("--ft-rank-heartbeat-timeout=" + str(args.hb_timeout))
    env_client = "nvrx" if setting.launcher is NVRX else "ftrun"
    worker = [*model_args(args), "--save", setting.save, "--ckpt-every", str(args.ckpt_every),
              "--snapshot-every", str(setting.every)]  # fmt: skip
    client = "none" if setting.launcher is TORCHRUN_NO_SHARE else env_client
    os.environ["FTRUN_BENCH_CLIENT"] = client
    # A spare only where a node can be lost (a second node holds the replicas).
    launchers = LAYOUT["nnodes"] + (1 if setting.spare and LAYOUT["nnodes"] > 1 else 0)
    with job(setting.launcher, extra, worker, WORKER, launchers=launchers) as run:
        exits = Exits(run)
        first = run.wait(lambda: Lines.read(run.out).newest_step() >= 1 or None, 300)
        if first is None:
            raise RuntimeError(f"{setting.name}: never stepped; {run.describe()}")
        opened = min(ts for ts, _, k, _ in Lines.read(run.out).rows if k == "step")
        faults, own = [], {}
        for index, at in enumerate(range(args.every, int(args.duration), args.every)):
            kind = fault_kind(index, setting)
            run.wait(lambda at=at: None if time.time() < opened + at else True, args.duration)
            if not stepping_again(run, faults, opened + args.duration):
                break
            lines = Lines.read(run.out)
            fault = Fault(kind, time.time(), rank=(index + 1) % world(), before=lines.newest_step())
            own[len(faults)] = fire(run, fault)
            faults.append(fault)
        run.wait(lambda: None if time.time() < opened + args.duration else True, args.duration)
        exits.stop()
        lines = Lines.read(run.out)
        gained = lines.newest_step(opened + args.duration)
        for i, fault in enumerate(faults):
            analyse(fault, lines, exits, own[i], args.step_s)
        stall = slower_steps(lines, faults, args.step_s, opened + args.duration)
    shutil.rmtree(f"/dev/shm/nvrx-local-{run.tmp.name}", ignore_errors=True)  # NVRx's parts
    return gained * args.step_s / args.duration, faults, stall / max(1, len(faults))


def fault_kind(index: int, setting: Setting) -> str:
    """The kinds in turn; a SIGKILLed rank where the kind cannot happen or be seen: a lost node
    without a spare (or a second node to hold its replica), a hung rank under torchrun in a
    one-rank job (no collective waits on it: nothing would ever notice)."""
    kind = KINDS[index % len(KINDS)]
    if kind == "node" and not (setting.spare and LAYOUT["nnodes"] > 1):
        return "kill"
    if kind == "stop" and setting.launcher is TORCHRUN_NO_SHARE and world() == 1:
        return "kill"
    return kind


def slower_steps(lines: Lines, faults: list[Fault], step_s: float, until: float) -> float:
    """Seconds the steps took beyond the script's own step time, a rank's on average: every
    gap between a process's consecutive steps with no fault in it (the saves' stalls, and
    whatever their background work takes from the training)."""
    last: dict[int, tuple[float, float]] = {}
    extra = 0.0
    for ts, pid, key, value in lines.rows:
        if key != "step" or ts > until:
            continue
        before = last.get(pid)
        last[pid] = (ts, value)
        if before and value == before[1] + 1 and not any(before[0] < f.at < ts for f in faults):
            extra += ts - before[0] - step_s
    return max(0.0, extra / world())


def stepping_again(run: Job, faults: list[Fault], until: float) -> bool:
    """Whether every rank stepped, in a live process, since the previous fault (waited for
    until `until`): a fault never hits a job still recovering from the one before."""
    since = faults[-1].at if faults else 0.0

    def ready() -> bool | None:
        lines = Lines.read(run.out)
        stepped = {pid for ts, pid, k, _ in lines.rows if k == "step" and ts > since}
        live = [_pid_of_rank(run, rank) for rank in range(world())]
        return all(pid in stepped for pid in live) or None

    return bool(run.wait(ready, max(0.0, until - time.time())))


def analyse(fault: Fault, lines: Lines, exits: Exits, own: set[int], step_s: float):
    resumed = [(ts, v) for ts, _, k, v in lines.rows if k == "from" and ts > fault.at]
    if not resumed:
        return
    # Processes of the job when the fault fired (not a later life's) that ended after it and
    # before the job resumed (not at a later fault).
    ended = {pid: t for pid, t in exits.ended.items()
             if resumed[0][0] > t >= fault.at > exits.seen[pid]}  # fmt: skip
    stopped = [t for pid, t in ended.items() if pid not in own]
    # A one-rank job has no other worker to stop: the faulted process's own end is the sign;
    # none ended (an in-process restart): the raise was caught where it was raised.
    detected = min(stopped or list(ended.values()) or [fault.at])
    restored_from = int(resumed[0][1])
    back = [ts for ts, _, k, v in lines.rows if k == "step" and ts > resumed[0][0]]
    fault.detect = detected - fault.at
    fault.recover = (back[0] if back else resumed[-1][0]) - detected
    fault.redone = max(0, fault.before - restored_from)


def model_args(args: argparse.Namespace) -> list[str]:
    return [
        "--device", args.device, "--d-model", str(args.d_model), "--layers", str(args.layers),
        "--batch", str(args.batch), "--seq", str(args.seq), "--pg-timeout", str(args.pg_timeout),
    ]  # fmt: skip


def script_step_time(args: argparse.Namespace) -> float:
    """The script's own step time: a short job of it without saves, the median step gap."""
    os.environ["FTRUN_BENCH_CLIENT"] = "none"
    worker = [*model_args(args), "--save", "none"]
    with job(TORCHRUN_NO_SHARE, layout_args(), worker, WORKER, LAYOUT["nnodes"]) as run:
        run.wait(lambda: Lines.read(run.out).newest_step() >= args.calibrate_steps or None, 300)
        steps = [ts for ts, _, k, _ in Lines.read(run.out).rows if k == "step"]
    every = world()
    gaps = [b - a for a, b in zip(steps[::every], steps[every::every], strict=False)]
    return statistics.median(gaps[2:] or gaps)


def report(results: dict[str, list[tuple[float, list[Fault], float]]], args) -> None:
    rows = []
    for name, runs in results.items():
        goodputs = ", ".join(f"{g:.2f}" for g, _, _ in runs)
        faults = [f for _, fs, _ in runs for f in fs]
        for kind in KINDS:
            mine = [f for f in faults if f.kind == kind and f.detect is not None]
            # Fired, but the job was not stepping again when the window closed.
            missing = sum(1 for f in faults if f.kind == kind and f.detect is None)
            count = f"{len(mine)}" + (f" (+{missing} not back)" if missing else "")
            if not mine:
                if missing:
                    rows.append([name, goodputs, kind, count, *["-"] * 5])
                continue
            med = statistics.median
            detect, recover = med([f.detect for f in mine]), med([f.recover for f in mine])
            redone = med([f.redone for f in mine])
            lost = detect + recover + redone * args.step_s
            rows.append([name, goodputs, kind, count, f"{detect:.2f}", f"{recover:.2f}",
                         f"{redone:.1f}", f"{lost:.2f}",
                         f"{statistics.median(s for _, _, s in runs):.2f}"])  # fmt: skip
    headers = ["setting", "goodput", "fault", "n", "detect s", "recover s", "steps redone",
               "lost s", "stall s / interval"]  # fmt: skip
    print(table(headers, rows, args.markdown))
    print(f"{args.layout} ranks; script step time {args.step_s * 1e3:.0f} ms; a fault every "
          f"{args.every} s for {args.duration:.0f} s; "
          f"{machine_line(args.load_before)}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=90)
    parser.add_argument("--every", type=int, default=15)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--hb-timeout", type=float, default=3)
    parser.add_argument("--pg-timeout", type=float, default=30)
    parser.add_argument("--calibrate-steps", type=int, default=20)
    parser.add_argument("--layout", default="2x2", help="launchers x ranks each (1x1: one GPU)")
    keys = [s.key for s in SETTINGS]
    parser.add_argument("--settings", default=",".join(keys), help=f"comma-separated: {keys}")
    parser.add_argument("--step-time", type=float, help="the script's step time, s (not measured)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--json", type=Path, help="also write the figures there (bench/goodput/model.py reads them)"
    )
    # One launcher x 2 ranks: the smoke's 6 s hold one fault, never a lost node, and each rank
    # trains flat out (a third launcher and two more ranks cost the suite 15 CPU-s for nothing).
    sizes = {"duration": 6, "every": 3, "d_model": 32, "layers": 1, "seq": 16,
             "settings": "ft-snapshot", "step_time": 0.02, "layout": "1x2"}  # fmt: skip
    args = smoke.parse_args(parser, sizes, argv)
    LAYOUT["nnodes"], LAYOUT["nproc"] = (int(n) for n in args.layout.split("x"))
    take_charge()
    args.load_before = load_average()
    args.step_s = args.step_time or script_step_time(args)
    progress(f"script step time {args.step_s * 1e3:.0f} ms")
    results: dict[str, list] = {}
    for run in range(args.runs):
        for setting in settings(args):
            progress(f"run {run + 1}: {setting.name}")
            try:
                result = one_run(setting, args)
            except RuntimeError as exc:  # one setting's failure leaves the others' figures
                progress(f"  failed: {exc}")
                continue
            results.setdefault(setting.name, []).append(result)
            progress(summary(*result))
    report(results, args)
    if args.json:
        write_json(results, args)


def summary(goodput: float, faults: list[Fault], stall: float) -> str:
    """One run's figures on one line, as they come (a killed bench keeps its output)."""
    lost = [
        f"{f.kind} {f.detect or 0:.2f}+{f.recover or 0:.2f} s, {f.redone} redone" for f in faults
    ]
    return f"  goodput {goodput:.3f}, stall {stall:.2f} s an interval; " + "; ".join(lost)


def write_json(results: dict[str, list], args: argparse.Namespace) -> None:
    """Per setting: goodputs, stall per interval, and each fault's kind and lost seconds."""
    figures = {
        "step_s": args.step_s,
        "every_s": args.every,
        "duration_s": args.duration,
        "settings": {
            name: {
                "goodput": [g for g, _, _ in runs],
                "stall_per_interval_s": [s for _, _, s in runs],
                "faults": [dataclasses.asdict(f) for _, fs, _ in runs for f in fs],
            }
            for name, runs in results.items()
        },
    }
    args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
