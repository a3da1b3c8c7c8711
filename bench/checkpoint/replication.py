"""Local checkpoints through the launcher: stall, time until replicated, restore after a crash.

2 ft_launchers x 2 ranks of `bench/workers/ettr_worker.py --save ftrun --replicate`: every rank
saves its `--state-mib` state into node memory every `--save-every` steps with
`LocalCheckpointManager.save(is_async=True)`, and its node's agent copies the part to the agent
of the next node (a clique of 2). Per run, with the floor measured in the same run (each rank
times one copy of its state into preallocated tensors before training):

- stall: seconds `save()` held the step loop, less each process's first saves (new memory);
- to replicated: from `save()` returning to the `ckpt_replicated` event of that part (the copy
  verified on the peer), and the push's bandwidth;
- restore after a crash: a worker is SIGKILLed; every rank of the restarted job times
  find_latest + load + the copy into its state (the `restore` line).

    .venv/bin/python -m bench.checkpoint.replication [--sizes-mib 256 512] [--runs 3] [--markdown]
        [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import WORKERS, smoke
from bench.common.jobs import FT, WORLD, Job, job, take_charge
from bench.common.logs import read_lines, steady_stalls
from bench.common.report import Stats, load_average, machine_line, progress, table
from ftrun.eventlog.reader import load_events

WORKER = WORKERS / "ettr_worker.py"
SAVES = 8
WAIT_S = 180.0


@dataclasses.dataclass(frozen=True)
class Sample:
    memcpy: float
    stalls: list[float]
    to_replicated: list[float]
    push_gbps: list[float]
    restores: list[float]


def floors(out: Path) -> list[float]:
    values = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.log"
        for text in path.read_text().splitlines() if path.exists() else []:
            for field in text.split():
                if field.startswith("memcpy="):
                    values.append(float(field[7:]))
    return values


def replication(run: Job, saves: dict[tuple[int, int], float]) -> tuple[list[float], list[float]]:
    """(save returned -> copy verified on the peer, push GB/s) for each replicated part."""
    events = load_events(run.tmp / "logs")
    delays, rates = [], []
    for node_events in events.nodes.values():
        for event in node_events:
            if event.event != "ckpt_replicated":
                continue
            saved = saves.get((int(event.get("rank")), int(event.get("iteration"))))
            if saved is not None:
                delays.append(event.ts - saved)
                rates.append(event.num("bytes") / max(event.num("seconds"), 1e-9) / 1e9)
    return delays, rates


def one_run(mib: int, save_every: int) -> Sample | None:
    ckpt = Path(tempfile.mkdtemp(prefix="ftrun-repl-"))
    args = [
        "--ckpt-dir", str(ckpt), "--save", "ftrun", "--replicate", "--memcpy-floor",
        "--save-every", str(save_every), "--state-mib", str(mib),
    ]  # fmt: skip
    with job(FT, ("--max-restarts=3",), args, WORKER) as run:
        if not run.wait(lambda: _saved(run, SAVES), WAIT_S):
            progress(f"  fewer than {SAVES} saves; {run.describe()}")
            return None
        lines = {rank: read_lines(run.out, rank) for rank in range(WORLD)}
        saves = {(r, x.step): x.ts for r, ls in lines.items() for x in ls if x.kind == "save"}
        victim = next(x.pid for x in reversed(lines[1]) if x.kind == "step")
        os.kill(victim, signal.SIGKILL)
        restored = run.wait(lambda: _restores(run), WAIT_S)
        delays, rates = replication(run, saves)
        memcpy = floors(run.out)
    shutil.rmtree(ckpt, ignore_errors=True)
    if not restored:
        progress(f"  no restore after the crash; {run.describe()}")
        return None
    stalls = [s for ls in lines.values() for s in steady_stalls(ls)]
    return Sample(statistics.median(memcpy), stalls, delays, rates, restored)


def _saved(run: Job, count: int) -> bool | None:
    done = all(
        sum(x.kind == "save" for x in read_lines(run.out, rank)) >= count for rank in range(WORLD)
    )
    return True if done else None


def _restores(run: Job) -> list[float] | None:
    """Every rank's restore time in the job restarted after the crash (the first run had no
    checkpoint to restore)."""
    took = [
        [x.seconds for x in read_lines(run.out, r) if x.kind == "restore"] for r in range(WORLD)
    ]
    return [t[-1] for t in took] if all(took) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=40, help="steps (0.05 s each)")
    parser.add_argument("--markdown", action="store_true")
    args = smoke.parse_args(parser, {"sizes_mib": [4], "runs": 1, "save_every": 10})
    take_charge()
    load_before = load_average()
    rows = []
    for mib in args.sizes_mib:
        samples = []
        for index in range(args.runs):
            progress(f"{mib} MiB per rank, run {index + 1}/{args.runs}")
            sample = one_run(mib, args.save_every)
            if sample is not None:
                samples.append(sample)
        rows.append(render_row(mib, samples))
    headers = [
        "MiB/rank", "memcpy s", "stall s", "stall x memcpy", "save -> replicated s",
        "push GB/s", "restore after crash s", "restore x memcpy",
    ]  # fmt: skip
    print(table(headers, rows, args.markdown))
    print(f"runs: {args.runs} per size; medians (min-max) over every rank's values of all runs")
    print(machine_line(load_before))


def render_row(mib: int, samples: list[Sample]) -> list[str]:
    if not samples:
        return [str(mib), "failed", "", "", "", "", "", ""]
    memcpy = statistics.median(s.memcpy for s in samples)

    def pooled(field: str) -> Stats | None:
        return Stats.of([v for s in samples for v in getattr(s, field)])

    stall, delay, rate, restore = (
        pooled(f) for f in ("stalls", "to_replicated", "push_gbps", "restores")
    )
    return [
        str(mib),
        f"{memcpy:.3f}",
        stall.cell("{:.3f}") if stall else "",
        f"{stall.median / memcpy:.2f}" if stall else "",
        delay.cell() if delay else "",
        rate.cell() if rate else "",
        restore.cell("{:.3f}") if restore else "",
        f"{restore.median / memcpy:.2f}" if restore else "",
    ]


if __name__ == "__main__":
    sys.exit(main())
