"""What a local checkpoint costs the training loop, measured as a user would: ftrun's node tier
beside torch.save, DCP's async_save and the physical floors, per rank, on CPU.

The state (per `--sizes-mib`, default 1024 and 4096 MiB per rank) is shaped like a mixed-precision
model + Adam state: bf16 parameters (an embedding and `layers` blocks of differently sized
matrices, norms and biases), an fp32 master copy and fp32 `exp_avg` / `exp_avg_sq` per parameter,
an fp32 scalar `step` tensor per parameter, a bf16 buffer that makes the tensor bytes add up to
the size exactly, and plain values (iteration, loss scale, a config dict, param groups with a
tuple). Its values are random (`uniform_`), every page is touched before the runs. "The model"
is a second set of tensors like it, allocated and touched once: the memcpy floor and every
restore copy into it, as `load_state_dict` copies into a model that exists. glibc's mmap
threshold is fixed at 128 KiB (`mallopt`), so every large allocation is fresh memory in every
run (by default, freed blocks of up to 32 MiB would be reused warm from the run before).

Before each size, the bench checks that 4x the size fits in available RAM (the state, the model,
two parts in /dev/shm during the steady-state async save; or one part and the peer's receive
buffer), 2x in /dev/shm and 1x on the disk directory, and skips the size with a line saying so
otherwise. Every measurement runs once on a 4 MiB state first, untimed (imports, threads, first
connections). Then `--runs` runs, each of every measurement below in this order, so that load
changes on the machine hit them all; ratios are pair by pair (measurement of run i over the
floor of run i, median of the ratios). Seconds are `time.perf_counter` wall time; GB/s are 10^9
bytes per second, of the state's tensor bytes (the peer rows: of the part file's bytes).

Floors:
- memcpy: `dst.copy_(src)` for every tensor into the model's preallocated tensors: what moving
  the bytes costs at the least; the targets are ratios to it, taken in the same run;
- memcpy, fresh: `torch.empty_like` + `copy_` per tensor (page faults and zeroing included);
- memcpy into a new /dev/shm file: `posix_fallocate` + `mmap` + `copy_` into typed views, as
  ftrun's save does minus its own bookkeeping: what writing a new part to node memory costs the
  kernel (tmpfs allocates and zeroes the pages, each is faulted into the mapping);
- memcpy into that file again: a new mapping of the same, now allocated file with MAP_POPULATE,
  then `copy_`: what a save into recycled node memory would cost;
- CRC-32C of every tensor's bytes on one core (ftrun computes and verifies them on every core).

Saves (`FTRUN_CKPT_DIR` set to a fresh 0700 directory in /dev/shm, as the agent gives a
worker; `LocalCheckpointManager(root, session_id="bench", keep_complete=1)`, persist_to_disk=False`:
node memory only, its root unused):
- ftrun sync: `save(state, 1)`: flatten, allocate, copy, CRC-32, header, rename (no fsync: tmpfs);
- ftrun async, first: `save(state, 2, is_async=True)` until it returns, into new node memory
  (flatten, allocate, the one copy), as a worker's first saves are;
- ftrun async, steady state, stall: `save(state, 3, is_async=True)` until it returns: part 1,
  retired by save 2, is its rank's recycled file, still mapped, and save 3 copies into it (what
  every later save of a training run does). Target: <= 1.3x memcpy;
- ftrun async, complete: that call until `wait()` returns (checksums, header, rename, and the
  retirement of part 2), waited for at once;
- torch.save + fsync: `torch.save` to a file in a fresh directory on the disk (`--disk-dir`, not
  /dev/shm), then `flush` and `os.fsync`: the whole call stalls training;
- DCP async_save, stall and complete: `torch.distributed.checkpoint.async_save(state,
  checkpoint_id=<fresh disk dir>, no_dist=True)` until it returns (it stages a copy of every
  tensor in the caller), then until `.result()` (FileSystemWriter with its default
  `sync_files=True`: fsync). No process group: torch 2.13 saves on one process with
  `no_dist=True` (it warns; the warning is silenced).

Restores (a restarted worker after a crash, part 2 of the async save):
- ftrun load: a new manager's `find_latest()` + `load()`: header checks, mmap of the /dev/shm
  file (zero-copy), CRC-32C of every tensor;
- ftrun restore: that plus `dst.copy_` of every loaded tensor into the model: the full restore.
  Target: <= 1.5x memcpy;
- ftrun restore into the model: a new manager's `find_latest()` + `load(into=model's state)`:
  each tensor read with `preadv` straight into the model's tensor, its CRC-32C computed per
  1 MiB chunk as it lands (one pass). Target: <= 1.5x memcpy;
- torch.load restore: `torch.load(weights_only=True)` of the torch.save file, just written, so
  from the page cache (the best case for it), plus the same copy into the model.

Peer transfer (a lost node fetching the part from a peer's replica), over loopback, both ends in
this process (threads): a `PeerServer` whose handler replies with a `FileRegion` of the /dev/shm
part (sent with `os.sendfile`) and a new `PeerClient` per run (connection and handshake
included) that `fetch_into`s a preallocated, touched buffer. Its floor: a plain TCP connection
on 127.0.0.1, `sendall` of the same bytes (the part file mapped with MAP_POPULATE) into
`recv_into` the same buffer.

What moves the figures: everything that writes into memory not touched before (the fresh
floor, each save's new /dev/shm file, DCP's staging copy, torch.load) pays for the kernel's page
allocation, zeroing and faults, and on a VM whose balloon driver reports free pages to the host
(virtio_balloon, noted under the tables) also for host faults on pages freed a few seconds
before: those vary with which pages the kernel hands out. The async save runs while part 1 is
still held, so it needs memory the runs before did not just free, as a steady-state save (its
oldest part removed a checkpoint interval ago) does too.

The first run checks the model against the state after each restore and the fetched bytes
against the part (CRC-32), untimed. Every directory the bench creates in /dev/shm and on disk is
removed at the end, on errors, Ctrl-C and SIGTERM too. Raw per-run seconds go to
bench/out/checkpoint-<time>.json.

    python -m bench.checkpoint.checkpoint [--sizes-mib 1024 4096] [--runs 5] [--markdown] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import mmap
import os
import shutil
import socket
import statistics
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.distributed.checkpoint.state_dict_saver import async_save

from bench.common import OUT, exit_on_sigterm, smoke
from bench.common.report import load_average, machine_line, progress, table
from bench.common.state import (
    MIB,
    Scratch,
    build_state,
    copy_into,
    default_disk_dir,
    filesystem_type,
    fixed_malloc_threshold,
    like,
    same,
    shaped_as,
    tensors_of,
    torch_save_fsync,
)
from bench.common.timing import Stopwatch, seconds
from ftrun.checkpointing import LocalCheckpointManager
from ftrun.checkpointing.layout import checksum
from ftrun.environment import Env
from ftrun.peer import FileRegion, PeerClient, PeerServer, Reply, Request

GB = 1e9
SHM = Path("/dev/shm")
BALLOON = Path("/sys/bus/virtio/drivers/virtio_balloon")
HOST = "127.0.0.1"
SECRET = bytes(range(32))  # any 32 bytes: server and client are this process
JOB = "bench-checkpoint"
SESSION = "bench"
WARMUP_MIB = 4
MARGIN = 512 * MIB  # besides what the bench holds: the interpreter, torch, headers
FETCH_TIMEOUT_S = 600.0

STALL_TARGET = 1.3  # ftrun async save stall <= 1.3x memcpy into preallocated memory
RESTORE_TARGET = 1.5  # ftrun find_latest + load + copy into the model <= 1.5x memcpy


# ---- floors ------------------------------------------------------------------------------------


def measure_floors(scratch: Scratch, state: Any, model: list[torch.Tensor]) -> dict[str, float]:
    out = {"memcpy": seconds(lambda: copy_into(model, state))}

    def fresh() -> list[torch.Tensor]:
        copies = []
        for src in tensors_of(state):
            copies.append(torch.empty_like(src))
            copies[-1].copy_(src)
        return copies

    started = Stopwatch()
    copies = fresh()
    out["memcpy_fresh"] = started.seconds()
    del copies
    directory = scratch.mkdtemp(SHM, "ftrun-bench-floor-")
    try:
        out.update(shm_file_copies(directory / "floor.bin", state))
    finally:
        scratch.remove(directory)
    out["crc32"] = seconds(lambda: checksum_all(state))
    return out


def shm_file_copies(path: Path, state: Any) -> dict[str, float]:
    """Copy the tensors into a new file in /dev/shm through a mapping, as ftrun's save does;
    then again into that file, now allocated, through a new mapping made with MAP_POPULATE."""
    sources = list(tensors_of(state))
    total = sum(-(-t.numel() * t.element_size() // 8) * 8 for t in sources)

    def copy(mapping: mmap.mmap) -> None:
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # must not outlive the mapping
        offset = 0
        for src in sources:
            size = src.numel() * src.element_size()
            whole[offset : offset + size].view(src.dtype).view(src.shape).copy_(src)
            offset += -(-size // 8) * 8

    out = {}
    started = Stopwatch()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
        mapping = mmap.mmap(fd, total)
        copy(mapping)
        out["memcpy_shm_file"] = started.seconds()
        mapping.close()
        started = Stopwatch()
        mapping = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        copy(mapping)
        out["memcpy_shm_reused"] = started.seconds()
        mapping.close()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return out


def checksum_all(state: Any) -> None:
    """CRC-32C (one core) of every tensor's bytes: what `load` verifies."""
    for tensor in tensors_of(state):
        size = tensor.numel() * tensor.element_size()
        if size:
            checksum((ctypes.c_char * size).from_address(tensor.data_ptr()))


# ---- ftrun -------------------------------------------------------------------------------------


def measure_ftrun(
    tier: Path, state: Any, model: list[torch.Tensor], verify: bool
) -> tuple[dict[str, float], Path]:
    """Sync save (1), async saves (2: new memory, 3: steady state), restore (3) with the node
    tier in `tier`; returns part 3's path."""
    os.environ[Env.CKPT_DIR] = str(tier)
    try:
        persist = tier / "not-used"  # the manager's disk root; nothing is persisted there
        manager = LocalCheckpointManager(
            persist, session_id=SESSION, keep_complete=1, persist_to_disk=False
        )
        out = {"ftrun_sync_save": seconds(lambda: manager.save(state, 1))}
        started = Stopwatch()
        manager.save(state, 2, is_async=True)  # new memory: no part retired yet
        out["ftrun_async_first_stall"] = started.seconds()
        manager.wait()
        started = Stopwatch()
        manager.save(state, 3, is_async=True)  # steady state: into part 1's retired memory
        out["ftrun_async_stall"] = started.seconds()
        info = manager.wait()
        out["ftrun_async_complete"] = started.seconds()
        assert info is not None
        # A restarted worker: a new manager finds and loads the newest part.
        restarted = LocalCheckpointManager(
            persist, session_id=SESSION, keep_complete=1, persist_to_disk=False
        )
        started = Stopwatch()
        iteration = restarted.find_latest()
        loaded, _ = restarted.load()
        out["ftrun_load"] = started.seconds()
        copy_into(model, loaded)
        out["ftrun_restore"] = started.seconds()
        if iteration != 3:
            raise AssertionError(f"find_latest() said {iteration}, not 3")
        if verify:
            same(model, state, "ftrun restore")
        del loaded
        # The same restart, reading straight into the model (`load(into=...)`).
        if verify:
            for tensor in model:
                tensor.zero_()
        restarted = LocalCheckpointManager(
            persist, session_id=SESSION, keep_complete=1, persist_to_disk=False
        )
        target = shaped_as(state, model)
        started = Stopwatch()
        restarted.find_latest()
        restarted.load(into=target)
        out["ftrun_restore_into"] = started.seconds()
        if verify:
            same(model, state, "ftrun restore into the model")
    finally:
        os.environ.pop(Env.CKPT_DIR, None)
    return out, Path(info.path)


# ---- the peer channel --------------------------------------------------------------------------


class PartServer:
    """A PeerServer that sends the current part file with sendfile (a `FileRegion`)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.server = PeerServer(HOST, SECRET, JOB)
        self.server.register("part", self._serve)
        self.server.start()

    def _serve(self, request: Request) -> Reply:
        assert self.path is not None
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        size = os.fstat(fd).st_size
        return Reply({"size": size}, FileRegion(fd, 0, size), release=lambda: os.close(fd))

    def close(self) -> None:
        self.server.close()


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap]:
    """The file, mapped read-only and faulted in (MAP_POPULATE), as a sender's source."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        yield mapping
    finally:
        mapping.close()


def touched(size: int) -> mmap.mmap:
    """`size` bytes of anonymous memory with every page written: a preallocated buffer."""
    buffer = mmap.mmap(-1, size)
    block = b"\1" * (1 << 20)
    with memoryview(buffer) as view:
        for offset in range(0, size, len(block)):
            view[offset : offset + len(block)] = block[: size - offset]
    return buffer


def loopback(source: mmap.mmap, dest: mmap.mmap) -> float:
    """Seconds to move `source` into `dest` over a plain TCP connection on loopback."""
    with socket.create_server((HOST, 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    with sender, receiver, memoryview(source) as src, memoryview(dest) as dst:
        thread = threading.Thread(target=sender.sendall, args=(src,), daemon=True)
        started = Stopwatch()
        thread.start()
        got = 0
        while got < len(dst):
            count = receiver.recv_into(dst[got:])
            if count == 0:
                raise ConnectionError("the loopback sender closed early")
            got += count
        elapsed = started.seconds()
        thread.join()
    return elapsed


def measure_peer(server: PartServer, part: Path, verify: bool) -> dict[str, float]:
    size = part.stat().st_size
    dest = touched(size)
    try:
        with mapped(part) as source:
            out = {"loopback_raw": loopback(source, dest)}
            if verify:  # the check below must see the fetch's bytes, not the loopback's
                ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(dest)), 0, size)
            server.path = part
            with PeerClient(SECRET, JOB) as client:
                out["peer_fetch"] = seconds(
                    lambda: client.fetch_into(
                        HOST, server.server.port, "part", {}, dest, timeout=FETCH_TIMEOUT_S
                    )
                )
            if verify and checksum(dest) != checksum(source):
                raise AssertionError("the fetched part differs from the part file")
    finally:
        dest.close()
    return out


# ---- torch.save and DCP ------------------------------------------------------------------------


def measure_torch(
    scratch: Scratch, state: Any, model: list[torch.Tensor], verify: bool
) -> dict[str, float]:
    directory = scratch.mkdtemp(scratch.disk, "ftrun-bench-torch-")
    try:
        path = directory / "state.pt"
        out = {"torch_save_fsync": seconds(lambda: torch_save_fsync(state, path))}
        started = Stopwatch()
        loaded = torch.load(path, weights_only=True)
        out["torch_load"] = started.seconds()
        copy_into(model, loaded)
        out["torch_load_restore"] = started.seconds()
        if verify:
            same(model, state, "torch.load restore")
        del loaded
    finally:
        scratch.remove(directory)
    return out


def measure_dcp(scratch: Scratch, state: Any) -> dict[str, float]:
    directory = scratch.mkdtemp(scratch.disk, "ftrun-bench-dcp-")
    try:
        with warnings.catch_warnings():
            # "torch.distributed is disabled, unavailable or uninitialized, assuming ..."
            warnings.simplefilter("ignore", UserWarning)
            started = Stopwatch()
            pending = async_save(state, checkpoint_id=str(directory), no_dist=True)
            stall = started.seconds()
            future = getattr(pending, "upload_completion", pending)
            future.result()
            complete = started.seconds()
    finally:
        scratch.remove(directory)
    return {"dcp_async_stall": stall, "dcp_async_complete": complete}


# ---- one run, one size -------------------------------------------------------------------------


def one_run(
    scratch: Scratch, server: PartServer, state: Any, model: list[torch.Tensor], verify: bool
) -> tuple[dict[str, float], int]:
    """Every measurement once; their seconds, and the part file's size."""
    out = measure_floors(scratch, state, model)
    tier = scratch.mkdtemp(SHM, "ftrun-bench-ckpt-")  # 0700, as the agent makes it
    try:
        ftrun, part = measure_ftrun(tier, state, model, verify)
        out.update(ftrun)
        part_bytes = part.stat().st_size
        out.update(measure_peer(server, part, verify))
    finally:
        scratch.remove(tier)
    out.update(measure_torch(scratch, state, model, verify))
    out.update(measure_dcp(scratch, state))
    return out, part_bytes


def does_not_fit(nbytes: int, disk: Path) -> str | None:
    """Why a state of `nbytes` cannot be measured without swapping or filling a disk; or None."""
    needs = (
        ("RAM (available)", psutil.virtual_memory().available, 4 * nbytes + MARGIN),
        (f"{SHM} (free)", shutil.disk_usage(SHM).free, 2 * nbytes + 64 * MIB),
        (f"{disk} (free)", shutil.disk_usage(disk).free, nbytes + MARGIN),
    )
    short = [
        f"{where} has {have / MIB:.0f} MiB, needs {need / MIB:.0f}"
        for where, have, need in needs
        if have < need
    ]
    return "; ".join(short) or None


@dataclasses.dataclass
class SizeResult:
    mib: int
    nbytes: int
    tensors: int = 0
    part_bytes: int = 0
    skipped: str | None = None
    runs: list[dict[str, float]] = dataclasses.field(default_factory=list)


def measure_size(
    mib: int, runs: int, scratch: Scratch, server: PartServer, result: SizeResult
) -> None:
    nbytes = mib * MIB
    result.skipped = does_not_fit(nbytes, scratch.disk)
    if result.skipped:
        progress(f"{mib} MiB: skipped: {result.skipped}")
        return
    progress(f"{mib} MiB: building the state")
    state = build_state(nbytes)
    model = like(state)
    result.tensors = len(model)
    for run in range(runs):
        figures, result.part_bytes = one_run(scratch, server, state, model, verify=run == 0)
        result.runs.append(figures)
        brief = ", ".join(f"{k} {v:.3f}" for k, v in figures.items())
        progress(f"  run {run + 1}/{runs}: {brief}")


def warm_up(scratch: Scratch, server: PartServer) -> None:
    """Every measurement once on a small state, untimed, checking what it restores."""
    state = build_state(WARMUP_MIB * MIB)
    one_run(scratch, server, state, like(state), verify=True)


# ---- the table ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    label: str
    floor: str = "memcpy"  # the floor of its ratio: memcpy | loopback_raw
    target: float | None = None


ROWS = (
    Row("memcpy", "floor: memcpy into preallocated tensors (dst.copy_)"),
    Row("memcpy_fresh", "floor: memcpy into fresh tensors (empty_like + copy_)"),
    Row("memcpy_shm_file", "floor: memcpy into a new /dev/shm file (fallocate + mmap + copy_)"),
    Row("memcpy_shm_reused", "floor: memcpy into that file again (mmap MAP_POPULATE + copy_)"),
    Row("crc32", "floor: CRC-32C of every tensor (one core)"),
    Row("ftrun_async_first_stall", "ftrun async save, first (new memory): stall"),
    Row(
        "ftrun_async_stall",
        "ftrun async save, steady state: stall (save returns)",
        target=STALL_TARGET,
    ),
    Row("ftrun_async_complete", "ftrun async save: complete (save + wait: CRC, rename)"),
    Row("ftrun_sync_save", "ftrun sync save"),
    Row("torch_save_fsync", "torch.save to disk + fsync (all stall)"),
    Row("dcp_async_stall", "DCP async_save to disk: stall (returns)"),
    Row("dcp_async_complete", "DCP async_save to disk: complete (.result(), fsync)"),
    Row("ftrun_load", "ftrun restore: find_latest + load (mmap, CRC)"),
    Row(
        "ftrun_restore",
        "ftrun restore: find_latest + load + copy into the model",
        target=RESTORE_TARGET,
    ),
    Row(
        "ftrun_restore_into",
        "ftrun restore: find_latest + load(into=model) (read + CRC in one pass)",
        target=RESTORE_TARGET,
    ),
    Row("torch_load", "torch.load (page cache)"),
    Row("torch_load_restore", "torch.load (page cache) + copy into the model"),
    Row("loopback_raw", "floor: TCP loopback, sendall -> recv_into", floor="loopback_raw"),
    Row("peer_fetch", "ftrun peer fetch_into (sendfile from /dev/shm)", floor="loopback_raw"),
)
FLOOR_NAMES = {"memcpy": "memcpy", "loopback_raw": "loopback"}


def _range(values: list[float], fmt: str) -> str:
    text = fmt.format(statistics.median(values))
    if len(values) > 1:
        text += f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
    return text


def render(result: SizeResult, markdown: bool) -> str:
    rows = []
    for row in ROWS:
        values = [run[row.key] for run in result.runs if row.key in run]
        if not values:
            continue
        ratios = [run[row.key] / run[row.floor] for run in result.runs if run.get(row.floor)]
        nbytes = result.part_bytes if row.floor == "loopback_raw" else result.nbytes
        median = statistics.median(values)
        floor_s = statistics.median(run[row.floor] for run in result.runs)
        target = ""
        if row.target is not None:
            verdict = "PASS" if statistics.median(ratios) <= row.target else "NO"
            target = f"<= {row.target}x memcpy: {verdict}"
        rows.append(
            [
                row.label,
                _range(values, "{:.3f}"),
                f"{nbytes / median / GB:.2f}",
                _range(ratios, "{:.2f}"),
                f"{FLOOR_NAMES[row.floor]} {floor_s:.3f} s",
                target,
            ]
        )
    headers = ["measurement", "s", "GB/s", "x floor", "floor", "target"]
    return table(headers, rows, markdown)


def caption(result: SizeResult) -> str:
    return (
        f"{result.mib} MiB per rank ({result.nbytes} tensor bytes in {result.tensors} tensors, "
        f"part file {result.part_bytes} bytes), {len(result.runs)} run(s)"
    )


# ---- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes-mib",
        type=int,
        nargs="+",
        default=[1024, 4096],
        metavar="MIB",
        help="per-rank state sizes in MiB (default 1024 4096)",
    )
    parser.add_argument("--runs", type=int, default=5, help="interleaved runs (default 5)")
    parser.add_argument(
        "--disk-dir",
        type=Path,
        default=None,
        help="where torch.save and DCP write (default: the temp dir, if not a tmpfs; /var/tmp)",
    )
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--json", type=Path, help="raw results (default bench/out/checkpoint-*)")
    args = smoke.parse_args(parser, {"sizes_mib": [WARMUP_MIB], "runs": 1})
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if any(m < WARMUP_MIB for m in args.sizes_mib):
        parser.error(f"sizes must be at least {WARMUP_MIB} MiB")
    args.disk_dir = args.disk_dir or default_disk_dir()
    if not args.disk_dir.is_dir():
        parser.error(f"--disk-dir {args.disk_dir} is not a directory")
    return args


def main() -> None:
    args = parse_args()
    exit_on_sigterm()
    if not fixed_malloc_threshold():
        progress("could not fix malloc's mmap threshold: fresh allocations may reuse memory")
    load = load_average()
    started = time.strftime("%Y%m%d-%H%M%S")
    disk_fs = filesystem_type(args.disk_dir)
    results = [SizeResult(mib, mib * MIB) for mib in args.sizes_mib]
    scratch = Scratch(args.disk_dir)
    server = None
    try:
        server = PartServer()
        progress(f"warm-up ({WARMUP_MIB} MiB); disk dir {args.disk_dir} ({disk_fs})")
        warm_up(scratch, server)
        for result in results:
            measure_size(result.mib, args.runs, scratch, server, result)
    finally:
        if server is not None:
            server.close()
        scratch.close()
    for result in results:
        if result.skipped:
            print(f"\n{result.mib} MiB per rank: skipped: {result.skipped}")
        else:
            print(f"\n{caption(result)}\n{render(result, args.markdown)}")
    print(
        "\ns: median (min-max) over runs; GB/s: bytes / median s (10^9 B/s; tensor bytes, peer "
        "rows the part file); x floor: median (min-max) of run i / its floor of run i; "
        f"disk dir {args.disk_dir} ({disk_fs})"
    )
    threads = torch.get_num_threads()
    machine = f"{machine_line(load)}; torch {torch.__version__}, {threads} intra-op threads"
    if BALLOON.is_dir():
        machine += "; a VM with virtio_balloon (freed memory may go back to the host)"
    print(machine)
    path = args.json or OUT / f"checkpoint-{started}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine,
        "torch": torch.__version__,
        "torch_threads": threads,
        "disk_dir_fs": disk_fs,
        "sizes": [dataclasses.asdict(r) for r in results],
    }
    path.write_text(json.dumps(raw, indent=1))
    progress(f"raw results: {path}")


if __name__ == "__main__":
    main()
