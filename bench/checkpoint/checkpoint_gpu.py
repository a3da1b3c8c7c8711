"""What a local checkpoint of a CUDA state costs the training loop, on one GPU: ftrun's node
tier beside DCP's async_save, NVRx's LocalCheckpointManager and the device-to-host floors.

The state (`--gib`, default 8 GiB, all on the GPU) is shaped like a mixed-precision model + Adam
state: bf16 parameters (an embedding, 16 blocks of differently sized matrices, norms and
biases), an fp32 master copy and fp32 `exp_avg` / `exp_avg_sq` per parameter, an fp32 scalar
`step` per parameter, a bf16 buffer that makes the bytes add up, and plain values: ~570
tensors. Every tensor is on the GPU (NVRx's `BasicTensorAwareStateDict` requires it), filled
with random values. The size counts each tensor rounded up to 8 bytes, as a part lays it out.

Every measurement runs once on a 64 MiB state first, untimed (imports, CUDA context, threads).
Then `--runs` runs, each of every measurement below in this order; ratios are pair by pair
(run i over the pinned floor of run i, median of the ratios). Seconds are `time.perf_counter`
wall time after a `torch.cuda.synchronize()`; GB/s are 10^9 bytes per second of the state.

Floors, into host memory allocated (and touched) once before the runs:
- D2H pinned: `copy_(non_blocking=True)` of every tensor into views of one pinned buffer
  (`torch.empty(..., pin_memory=True)`), then one synchronize: what the bus carries at most;
- D2H pageable: `copy_` of every tensor into views of one pageable buffer.

Saves:
- ftrun (`FTRUN_CKPT_DIR` = a fresh directory in /dev/shm, as the agent gives a worker;
  `LocalCheckpointManager(root, session_id="b", keep_complete=1, persist_to_disk=False)`):
  async saves 1, 2, 3, each waited for (`wait()`) before the next. Save 1 copies into new node
  memory (a new file, page-locked once); save 3 into the file that save 2 retired, still mapped and
  page-locked (every later save of a run is like it). Rows: save 1's stall (until `save` returns),
  save 3's stall (target: <= 1.3x D2H pinned) and save 3 until `wait()` returns (CRC-32, header,
  rename, retiring part 2). Run 1 then reads part 3 back and compares it with the state;
- DCP: `torch.distributed.checkpoint.async_save(state, checkpoint_id=<fresh dir on --disk-dir>,
  no_dist=True)` until it returns (its default stager copies every tensor to new pageable
  memory in the caller), then until `.result()` (written and fsynced);
- NVRx (if `nvidia_resiliency_ext` imports: on the device, `. bench/device_setup.sh` puts it on
  PYTHONPATH): its `LocalCheckpointManager(<fresh dir in /dev/shm>, session_id="b")` with a
  one-process gloo group, saves 1, 2, 3 of `BasicTensorAwareStateDict(<the state>)`
  with `is_async=True` (each `.to("cpu", non_blocking=True)`, from torch's caching pinned
  allocator, then `torch.cuda.synchronize()`); each request is run at once with
  `execute_sync()` (torch.save into /dev/shm, then its finalize: find_latest, clean-up), in the
  caller; NVRx's own queue would run it in a forked process. Rows: save 1's stall (new pinned
  memory), save 3's (the allocator's cached blocks) and save 3 until `execute_sync` returns.
  Torch's pinned cache is emptied after each run.

Before the runs the bench checks that /dev/shm holds 3 copies (ftrun holds 2 in its steady
state, NVRx up to 3: its clean-up runs behind) and shrinks `--gib` to fit if not, saying so;
DCP is skipped if the disk dir cannot hold one copy. Every directory it makes is removed at
the end, on errors and SIGTERM too; after each ftrun run it checks that no mapping is still
page-locked and /dev/shm is back to its usage before. Raw per-run seconds go to `--json`
(default bench/out/checkpoint-gpu-*.json).

    python -m bench.checkpoint.checkpoint_gpu [--gib 8] [--runs 3] [--markdown] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench.common import OUT, exit_on_sigterm, smoke
from bench.common.report import load_average, machine_line, progress, table
from bench.common.state import (
    MIB,
    Scratch,
    default_disk_dir,
    filesystem_type,
    matrix_shares,
    tensors_of,
    vector_names,
)
from bench.common.timing import Stopwatch, seconds
from ftrun.checkpointing import LocalCheckpointManager, pinning
from ftrun.checkpointing.format import read_part
from ftrun.environment import Env

GIB = 2**30
GB = 1e9
SHM = Path("/dev/shm")
WARMUP_BYTES = 64 * MIB
ALIGN = 8
LAYERS = 16
STALL_TARGET = 1.3  # ftrun steady-state async save stall <= 1.3x the pinned D2H copy
SHM_PARTS = 3.1  # ftrun: 2 parts at once; NVRx: up to 3 files (its clean-up is async)

ROWS = [  # key, label
    ("d2h_pinned", "D2H copy into pinned memory (floor)"),
    ("d2h_pageable", "D2H copy into pageable memory"),
    ("ftrun_first_stall", "ftrun async save, new memory (save 1): stall"),
    ("ftrun_stall", "ftrun async save, steady state (save 3): stall"),
    ("ftrun_complete", "ftrun async save, steady state: until wait()"),
    ("dcp_stall", "DCP async_save: stall"),
    ("dcp_complete", "DCP async_save: until .result()"),
    ("nvrx_first_stall", "NVRx save(is_async), save 1: stall"),
    ("nvrx_stall", "NVRx save(is_async), save 3: stall"),
    ("nvrx_complete", "NVRx save 3: until execute_sync()"),
]


# ---- the state -----------------------------------------------------------------------------


def aligned(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN


def build_state(nbytes: int, device: torch.device) -> dict[str, Any]:
    """A model + Adam state on `device` of exactly `nbytes` (8-byte aligned tensor bytes)."""
    params_total = nbytes // 14  # per parameter: bf16 weight + 3 fp32 (master, 2 moments)
    shares = matrix_shares(LAYERS)
    shapes = {n: (max(1, int(params_total * s * 0.98) // 1024), 1024) for n, s in shares.items()}
    shapes.update(dict.fromkeys(vector_names(LAYERS), (1024,)))

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    state: dict[str, Any] = {
        "model": {n: empty(s, torch.bfloat16) for n, s in shapes.items()},
        "master_params": {n: empty(s, torch.float32) for n, s in shapes.items()},
        "optimizer": {
            "state": {
                n: {
                    "step": torch.full((), 1000.0, device=device),
                    "exp_avg": empty(s, torch.float32),
                    "exp_avg_sq": empty(s, torch.float32),
                }
                for n, s in shapes.items()
            },
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(shapes)}],
        },
        "iteration": 1000,
        "config": {"model": "bench-llm", "layers": LAYERS},
    }
    rest = nbytes - sum(aligned(t) for t in tensors_of(state))
    if rest < ALIGN or rest % ALIGN:
        raise ValueError(f"cannot shape a state of {nbytes} bytes (left: {rest})")
    state["model"]["rope.cache"] = empty((rest // 2,), torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(nbytes)
    for tensor in tensors_of(state):
        if tensor.is_floating_point() and tensor.dim() > 0:
            tensor.uniform_(-1.0, 1.0, generator=generator)
    torch.cuda.synchronize(device)
    return state


def views(buffer: torch.Tensor, state: Any) -> list[torch.Tensor]:
    """Typed views of `buffer` (uint8), one per tensor of `state`, laid out as a part would."""
    out, offset = [], 0
    for tensor in tensors_of(state):
        size = tensor.numel() * tensor.element_size()
        out.append(buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape))
        offset += aligned(tensor)
    return out


def wrap(state: Any) -> Any:
    """A copy of the containers (not of the tensors): NVRx replaces the tensors in place."""
    if isinstance(state, dict):
        return {k: wrap(v) for k, v in state.items()}
    if isinstance(state, list):
        return [wrap(v) for v in state]
    return state


def clock(work: Callable[[], object]) -> float:
    torch.cuda.synchronize()  # what was queued before is not this call's time
    return seconds(work)


# ---- measurements ------------------------------------------------------------------------------


class Floors:
    """Host buffers for the floors, allocated and touched once."""

    def __init__(self, state: Any, nbytes: int) -> None:
        self.pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.pageable = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned.fill_(0)
        self.pageable.fill_(0)
        self.pinned_views = views(self.pinned, state)
        self.pageable_views = views(self.pageable, state)

    def measure(self, state: Any) -> dict[str, float]:
        sources = list(tensors_of(state))

        def pinned() -> None:
            for dst, src in zip(self.pinned_views, sources, strict=True):
                dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        def pageable() -> None:
            for dst, src in zip(self.pageable_views, sources, strict=True):
                dst.copy_(src)

        return {"d2h_pinned": clock(pinned), "d2h_pageable": clock(pageable)}


def shm_used() -> int:
    stat = os.statvfs(SHM)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def pinned_mappings() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is pinning.Mapping and o._pinned)


def measure_ftrun(scratch: Scratch, state: Any, verify: bool) -> dict[str, float]:
    used_before = shm_used()
    tier = scratch.mkdtemp(SHM, "ftrun-bench-gpu-")
    os.environ[Env.CKPT_DIR] = str(tier)
    out: dict[str, float] = {}
    try:
        manager = LocalCheckpointManager(
            tier / "not-used", session_id="b", keep_complete=1, persist_to_disk=False
        )
        torch.cuda.synchronize()
        started = Stopwatch()
        manager.save(state, 1, is_async=True)  # into new node memory
        out["ftrun_first_stall"] = started.seconds()
        manager.wait()
        manager.save(state, 2, is_async=True)
        manager.wait()
        torch.cuda.synchronize()
        started = Stopwatch()
        manager.save(state, 3, is_async=True)  # into part 1's file, retired by save 2
        out["ftrun_stall"] = started.seconds()
        info = manager.wait()
        out["ftrun_complete"] = started.seconds()
        assert info is not None and info.iteration == 3
        if verify:
            loaded, _ = read_part(info.path)
            pairs = zip(tensors_of(loaded), tensors_of(state), strict=True)
            if not all(torch.equal(a.to(b.device), b) for a, b in pairs):
                raise AssertionError("ftrun: part 3 differs from the state")
            del loaded, pairs
        del manager
    finally:
        os.environ.pop(Env.CKPT_DIR, None)
        scratch.remove(tier)
    left = pinned_mappings()
    if left:
        raise AssertionError(f"ftrun: {left} mapping(s) still page-locked after the run")
    grown = shm_used() - used_before
    if grown > 64 * MIB:
        raise AssertionError(f"ftrun: /dev/shm holds {grown / MIB:.0f} MiB more after the run")
    return out


def measure_dcp(scratch: Scratch, disk: Path, state: Any) -> dict[str, float]:
    from torch.distributed.checkpoint import async_save

    directory = scratch.mkdtemp(disk, "ftrun-bench-gpu-dcp-")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.cuda.synchronize()
            started = Stopwatch()
            future = async_save(state, checkpoint_id=str(directory), no_dist=True)
            stall = started.seconds()
            getattr(future, "upload_completion", future).result()
            complete = started.seconds()
    finally:
        scratch.remove(directory)
    return {"dcp_stall": stall, "dcp_complete": complete}


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_nvrx(scratch: Scratch, state: Any, nvrx: Any) -> dict[str, float]:
    manager_type, wrapper = nvrx
    root = scratch.mkdtemp(SHM, "ftrun-bench-gpu-nvrx-")
    out: dict[str, float] = {}
    try:
        with one_process_group():
            manager = manager_type(root, session_id="b")
            for iteration in (1, 2, 3):
                payload = wrapper(wrap(state))
                torch.cuda.synchronize()
                started = Stopwatch()
                request = manager.save(payload, iteration, is_async=True)
                stall = started.seconds()
                request.execute_sync()
                complete = started.seconds()
                del request, payload  # its CPU copies: back to torch's pinned cache
                if iteration == 1:
                    out["nvrx_first_stall"] = stall
            out["nvrx_stall"], out["nvrx_complete"] = stall, complete
    finally:
        scratch.remove(root)
        gc.collect()
        with contextlib.suppress(AttributeError):
            torch._C._host_emptyCache()
    return out


def load_nvrx() -> tuple[Any, str]:
    """NVRx's (LocalCheckpointManager, BasicTensorAwareStateDict) and its version, or
    (None, why not)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict,
        )
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager as NVRxManager,
        )
    except ImportError as e:
        return None, f"not importable ({e})"
    try:
        label = version("nvidia_resiliency_ext")
    except PackageNotFoundError:
        label = "?"
    return (NVRxManager, BasicTensorAwareStateDict), label


# ---- the report --------------------------------------------------------------------------------


def median_range(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-" + (
        f"{fmt.format(max(values))})"
    )


def render(runs: list[dict[str, float]], nbytes: int, labels: dict[str, str], md: bool) -> str:
    rows = []
    for key, label in ROWS:
        values = [run[key] for run in runs if key in run]
        if not values:
            continue
        ratios = [run[key] / run["d2h_pinned"] for run in runs if key in run]
        rows.append(
            [
                labels.get(key, label),
                median_range(values, "{:.3f}"),
                f"{nbytes / statistics.median(values) / GB:.1f}",
                median_range(ratios, "{:.2f}"),
            ]
        )
    return table(["measurement", "s", "GB/s", "x D2H pinned"], rows, md)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="state size in GiB (default 8)")
    parser.add_argument("--runs", type=int, default=3, help="runs (default 3)")
    parser.add_argument("--disk-dir", type=Path, default=None, help="where DCP writes")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", type=Path, help="raw results (default bench/out/...)")
    args = smoke.parse_args(parser, {"gib": 1 / 64, "runs": 1})
    if args.runs < 1 or args.gib <= 0:
        parser.error("--runs and --gib must be positive")
    args.disk_dir = args.disk_dir or default_disk_dir()
    return args


def sizes(args: argparse.Namespace) -> tuple[int, bool, list[str]]:
    """The state's size (cut to fit /dev/shm), whether DCP fits on the disk, and notes."""
    notes = []
    nbytes = int(args.gib * GIB) // ALIGN * ALIGN
    shm_free = shutil.disk_usage(SHM).free
    if nbytes * SHM_PARTS > shm_free:
        nbytes = int(shm_free / SHM_PARTS) // GIB * GIB
        notes.append(f"/dev/shm has {shm_free / GIB:.1f} GiB free: state cut to {nbytes / GIB} GiB")
        if nbytes <= 0:
            sys.exit(f"checkpoint_gpu: /dev/shm too small ({shm_free / GIB:.1f} GiB free)")
    dcp = shutil.disk_usage(args.disk_dir).free > nbytes * 1.1
    if not dcp:
        notes.append(f"DCP: not run ({args.disk_dir} cannot hold {nbytes / GIB:.1f} GiB)")
    return nbytes, dcp, notes


def report(runs: list[dict[str, float]], nbytes: int, count: int, labels: dict[str, str],
           args: argparse.Namespace) -> None:  # fmt: skip
    print(render(runs, nbytes, labels, args.markdown))
    stalls = [run["ftrun_stall"] / run["d2h_pinned"] for run in runs]
    verdict = "PASS" if statistics.median(stalls) <= STALL_TARGET else "NO"
    print(
        f"\ntarget: ftrun steady-state stall <= {STALL_TARGET}x D2H pinned: {verdict} "
        f"({statistics.median(stalls):.2f}x)"
    )
    print(
        f"state: {nbytes / GIB:.2f} GiB in {count} CUDA tensors; s: median (min-max) of "
        f"{args.runs} runs; GB/s: state bytes / median s; x D2H pinned: median (min-max) of run "
        f"i / its pinned D2H; DCP dir {args.disk_dir} ({filesystem_type(args.disk_dir)})"
    )


def main() -> None:
    args = parse_args()
    exit_on_sigterm()
    if not torch.cuda.is_available():
        smoke.skip_gpu("checkpoint_gpu", "every row (the state is on a GPU)")
        return
    load = load_average()
    started = time.strftime("%Y%m%d-%H%M%S")
    nbytes, dcp, notes = sizes(args)
    nvrx, nvrx_label = load_nvrx()
    if nvrx is None:
        notes.append(f"NVRx: not run ({nvrx_label})")
    labels = {k: v.replace("NVRx", f"NVRx {nvrx_label}") for k, v in ROWS if nvrx}
    device = torch.device("cuda", torch.cuda.current_device())
    scratch = Scratch(args.disk_dir)
    runs: list[dict[str, float]] = []

    def one_run(state: Any, floors: Floors, verify: bool) -> dict[str, float]:
        out = floors.measure(state)
        out.update(measure_ftrun(scratch, state, verify))
        if dcp:
            out.update(measure_dcp(scratch, args.disk_dir, state))
        if nvrx is not None:
            out.update(measure_nvrx(scratch, state, nvrx))
        return out

    try:
        progress(f"warm-up ({WARMUP_BYTES // MIB} MiB); disk dir {args.disk_dir}")
        small = build_state(WARMUP_BYTES, device)
        one_run(small, Floors(small, WARMUP_BYTES), verify=True)
        del small
        progress(f"state of {nbytes / GIB:.2f} GiB on {torch.cuda.get_device_name(device)}")
        state = build_state(nbytes, device)
        count = sum(1 for _ in tensors_of(state))
        floors = Floors(state, nbytes)
        for run in range(args.runs):
            runs.append(one_run(state, floors, verify=run == 0))
            progress(f"run {run + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[-1].items()))
    finally:
        scratch.close()
    report(runs, nbytes, count, labels, args)
    for note in notes:
        print(note)
    machine = (
        f"{machine_line(load)}; {torch.cuda.get_device_name(device)}; torch {torch.__version__}"
    )
    print(machine)
    path = args.json or OUT / f"checkpoint-gpu-{started}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = {"args": {k: str(v) for k, v in vars(args).items()}, "nbytes": nbytes}
    raw.update(machine=machine, notes=notes, nvrx=nvrx_label, runs=runs)
    path.write_text(json.dumps(raw, indent=1))
    progress(f"raw results: {path}")


if __name__ == "__main__":
    main()
