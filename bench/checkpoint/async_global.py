"""What an async global checkpoint costs the training loop: ftrun's `GlobalCheckpointManager`
beside DCP's own `async_save`, a sync `torch.save`, and the staging copy they all start with.

One rank (a gloo group of one on 127.0.0.1, so DCP runs its distributed path), a state shaped
like checkpoint.py's, `common.state.build_state` (`--size-mib`, default 1024), on CPU. Every
measurement runs once on a 4 MiB state first, untimed (imports, threads, and the check that the
saved state loads back equal); ftrun's first 1 GiB save (its staging buffers allocated) is
reported on its own row. Then `--runs` runs, each of every row in this order; ratios are to the
memcpy of the same run (median of the per-run ratios):

- memcpy: `dst.copy_(src)` of every tensor into preallocated, touched tensors (the floor);
- ftrun async stall: `save(state, i)` until it returns: one copy into the buffers of the save
  before (`dcp_safe.ReusingStager`), then DCP's `async_save` runs in its thread. Target: <= 1.3x;
- ftrun async complete: until `maybe_finalize(blocking=True)` returns (DCP's write with fsync,
  CRC-32C of the files, MANIFEST, rename);
- DCP async_save stall / complete: `async_save(state, checkpoint_id=<fresh dir>)` (DCP's
  default staging: a copy into new memory, page faults included), then `.result()`;
- torch.save + fsync: the whole call stalls training.

Checkpoints go to `--disk-dir` (default: a temp directory on a real disk); everything the bench
creates is removed at the end. Raw seconds go to `--json` (default
bench/out/async_global-<time>.json).

    python -m bench.checkpoint.async_global [--size-mib 1024] [--runs 3] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import async_save

from bench.common import OUT, smoke
from bench.common.jobs import free_port
from bench.common.report import load_average, machine_line, progress, table
from bench.common.state import (
    MIB,
    Scratch,
    build_state,
    copy_into,
    default_disk_dir,
    fixed_malloc_threshold,
    like,
    same,
    tensors_of,
    torch_save_fsync,
)
from bench.common.timing import Stopwatch, seconds
from ftrun.checkpointing import GlobalCheckpointManager, restore

ROWS = {
    "memcpy": "memcpy (floor)",
    "ftrun_stall": "ftrun async save, stall",
    "ftrun_complete": "ftrun async save, complete",
    "dcp_stall": "DCP async_save, stall",
    "dcp_complete": "DCP async_save, complete",
    "torch_save": "torch.save + fsync",
}


def init_one_rank() -> None:
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))


def measure_ftrun(manager: GlobalCheckpointManager, state: Any, iteration: int) -> dict[str, float]:
    started = Stopwatch()
    manager.save(state, iteration)
    stall = started.seconds()
    manager.maybe_finalize(blocking=True)
    return {"ftrun_stall": stall, "ftrun_complete": started.seconds()}


def measure_dcp(scratch: Scratch, state: Any) -> dict[str, float]:
    directory = scratch.mkdtemp(scratch.disk, "ftrun-bench-dcp-")
    try:
        started = Stopwatch()
        pending = async_save(state, checkpoint_id=str(directory))
        stall = started.seconds()
        getattr(pending, "upload_completion", pending).result()
        return {"dcp_stall": stall, "dcp_complete": started.seconds()}
    finally:
        scratch.remove(directory)


def measure_torch(scratch: Scratch, state: Any) -> dict[str, float]:
    directory = scratch.mkdtemp(scratch.disk, "ftrun-bench-torch-")
    try:
        return {"torch_save": seconds(lambda: torch_save_fsync(state, directory / "state.pt"))}
    finally:
        scratch.remove(directory)


def one_run(
    scratch: Scratch, manager: GlobalCheckpointManager, state: Any, model: Any, iteration: int
) -> dict[str, float]:
    out = {"memcpy": seconds(lambda: copy_into(model, state))}
    out.update(measure_ftrun(manager, state, iteration))
    out.update(measure_dcp(scratch, state))
    out.update(measure_torch(scratch, state))
    return out


def warm_up(scratch: Scratch) -> None:
    """Every path once on 4 MiB, and the check that ftrun's checkpoint loads back equal."""
    state = build_state(4 * MIB)
    manager = GlobalCheckpointManager(scratch.mkdtemp(scratch.disk, "ftrun-bench-warm-"))
    one_run(scratch, manager, state, like(state), 1)
    target = build_state(4 * MIB)
    for tensor in tensors_of(target):
        tensor.zero_()
    restore([manager], target)
    same(list(tensors_of(target)), state, "ftrun global restore")
    manager.close()


def report(runs: list[dict[str, float]], first_stall: float, nbytes: int) -> str:
    rows = []
    for key, label in ROWS.items():
        median_s = statistics.median(run[key] for run in runs)
        ratio = statistics.median(run[key] / run["memcpy"] for run in runs)
        rows.append([label, f"{median_s:.3f}", f"{nbytes / median_s / 1e9:.2f}", f"{ratio:.2f}x"])
    rows.insert(2, ["ftrun async save, first (new buffers)", f"{first_stall:.3f}", "", ""])
    return table(["per rank, CPU", "seconds (median)", "GB/s", "x memcpy"], rows, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--disk-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="raw results (default bench/out/async_global-*)")
    args = smoke.parse_args(parser, {"size_mib": 4, "runs": 1})
    load_before = load_average()
    fixed_malloc_threshold()
    init_one_rank()
    scratch = Scratch(args.disk_dir or default_disk_dir())
    try:
        progress("warm-up (4 MiB)")
        warm_up(scratch)
        state = build_state(args.size_mib * MIB)
        model = like(state)
        manager = GlobalCheckpointManager(scratch.mkdtemp(scratch.disk, "ftrun-bench-global-"))
        first_stall = measure_ftrun(manager, state, 1)["ftrun_stall"]
        runs = []
        for i in range(args.runs):
            progress(f"run {i + 1}/{args.runs} ({args.size_mib} MiB)")
            runs.append(one_run(scratch, manager, state, model, i + 2))
        manager.close()
    finally:
        scratch.close()
        dist.destroy_process_group()
    nbytes = args.size_mib * MIB
    print(report(runs, first_stall, nbytes))
    print(machine_line(load_before))
    out = args.json or OUT / f"async_global-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"size_mib": args.size_mib, "first_stall": first_stall,
                               "runs": runs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
