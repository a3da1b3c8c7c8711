"""Where a restarted GPU worker's first seconds go, and what a worker that made its CUDA
context before the restart would save (issue 40: restart cost flat in GPUs per node).

A torch-imported parent (as the fork server is) forks `--ranks` children at once; each waits on
a pipe, then, on "go", does what `bench/workers/gpu_user_worker.py`'s set-up does, timing each
phase from the go: `torch.cuda.set_device`, the 151M model built on the CPU, moved to the GPU,
`init_process_group("nccl")` (on `--store`: a FileStore; a TCPStore that rank 0 hosts, as
`env://` without the agent's store; or one listening before the ranks start), DDP's
construction (its first NCCL use), one step. Modes: `cold` (nothing before the go: a restarted
worker without prestarting), `warm` (the child made its CUDA context before the go:
`set_device` on its GPU), `warm-nccl` (and ran NCCL's one-time initialisation:
`torch.cuda.nccl.unique_id()`), `warm-topo` (NCCL's topology and graphs read from files that the
mode's first round had NCCL dump: `NCCL_TOPO_FILE`, `NCCL_GRAPH_FILE`). Modes interleave round
by round; each line is the slowest rank's time to each phase, then medians. With
`NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT` NCCL prints its own "Init timings" per rank.

    python3 -m bench.restart.cuda_standby_probe --ranks 1,4 --rounds 3
    python3 -m bench.restart.cuda_standby_probe --guard   # what a prestarted worker leaves

`--guard` checks `ftrun.agent.prewarm.child.make_cuda_context` in a forked child: the context on
the asked GPU alone (nvidia-smi's compute apps), torch's current device still 0, the script's
`set_device` then free, and the context's GPU memory.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch._dynamo  # as the fork server's deep import: not in DDP's phase
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.common import smoke
from bench.common.gpu_host import cuda_in_child
from bench.common.harness import free_port

PHASES = ("device", "cpu_model", "gpu_model", "pg", "ddp", "step")
MODES = ("cold", "warm", "warm-nccl", "warm-topo")
TOPO_FILES: dict[str, str] = {}
"""Where `warm-topo`'s first round has NCCL dump its topology and graphs, for later rounds to
read instead of detecting and searching them again (set in `main`; the children inherit it)."""


def build_model() -> nn.Module:
    layer = nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)


def child(rank: int, world: int, mode: str, store_at: str, ready_w: int, go_r: int,
          out_w: int) -> None:  # fmt: skip
    torch.set_num_threads(1)
    if mode != "cold":
        torch.cuda.set_device(rank)
    if mode == "warm-nccl":
        torch.cuda.nccl.unique_id()
    if mode == "warm-topo":  # the first round dumps them (one more topology write)
        dumped = all(os.path.exists(path) for path in TOPO_FILES.values())
        for name, path in TOPO_FILES.items():
            os.environ[name if dumped else name.replace("_FILE", "_DUMP_FILE")] = path
    os.write(ready_w, b"r")
    os.read(go_r, 1)
    times = {}
    t0 = time.monotonic()

    def mark(name: str) -> None:
        times[name] = time.monotonic() - t0

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    mark("device")
    torch.manual_seed(0)
    model = build_model()
    mark("cpu_model")
    model = model.to(device)
    torch.cuda.synchronize()
    mark("gpu_model")
    if store_at.startswith("tcp:"):  # rank 0 hosts it (torchrun's env:// without agent store)
        port = int(store_at[4:])
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, multi_tenant=True)
    elif store_at.startswith("client:"):  # hosted before any rank started
        store = dist.TCPStore("127.0.0.1", int(store_at[7:]), world, False)
    else:
        store = dist.FileStore(store_at, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    mark("pg")
    ddp = DDP(model, device_ids=[rank])
    mark("ddp")
    data = torch.randn(8, 512, 1024, device=device)
    loss = ddp(data).square().mean()
    loss.backward()
    loss.item()
    mark("step")
    os.write(out_w, (json.dumps(times) + "\n").encode())
    dist.destroy_process_group()
    os._exit(0)


def one_round(world: int, mode: str, store: str) -> dict[str, float]:
    """The slowest rank's time to each phase, from the go."""
    store_path = tempfile.mktemp(prefix="probe-store-")
    host = None
    if store != "file":
        port = free_port()
        store_path = f"tcp:{port}"
    if store == "hosted":
        code = (
            f"import torch.distributed as d, time; s = d.TCPStore('127.0.0.1', {port}, {world}, "
            "True, wait_for_workers=False); print('up', flush=True); time.sleep(60)"
        )
        host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert host.stdout is not None and host.stdout.readline() == "up\n"
        store_path = f"client:{port}"
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            try:
                child(rank, world, mode, store_path, ready_w, go_r, out_w)
            finally:
                os._exit(1)
        pids.append(pid)
    for _ in range(world):
        os.read(ready_r, 1)
    time.sleep(0.5)  # the warm children's contexts settle; nothing else runs meanwhile
    os.write(go_w, b"g" * world)
    results = []
    with os.fdopen(out_r) as lines:
        os.close(out_w)
        for _ in range(world):
            results.append(json.loads(lines.readline()))
    for pid in pids:
        os.waitpid(pid, 0)
    for fd in (ready_r, ready_w, go_r, go_w):
        os.close(fd)
    if os.path.exists(store_path):
        os.unlink(store_path)
    if host is not None:
        host.kill()
        host.wait()
    return {phase: max(r[phase] for r in results) for phase in PHASES}


def guard(device: int) -> None:
    """A prestarted worker's context, as `make_cuda_context` leaves it."""
    from ftrun.agent.prewarm.child import make_cuda_context

    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        t0 = time.monotonic()
        make_cuda_context(device)
        made = time.monotonic() - t0
        current = torch.cuda.current_device()
        t1 = time.monotonic()
        torch.cuda.set_device(device)
        set_after = time.monotonic() - t1
        os.write(done_w, json.dumps([made, current, set_after]).encode())
        time.sleep(3)
        os._exit(0)
    made, current, set_after = json.loads(os.read(done_r, 1000))
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    mine = [line for line in apps.splitlines() if line.startswith(f"{pid},")]
    print(
        f"guard device={device}: context made in {made:.3f} s; current_device={current}; "
        f"set_device after it {set_after:.4f} s; the child's GPU contexts: {mine}",
        flush=True,
    )
    os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guard", action="store_true")
    parser.add_argument("--ranks", default="1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--store", choices=["file", "rank0", "hosted"], default="file",
                        help="the process group's store: a file; a TCPStore that rank 0 hosts; "
                        "one hosted before the ranks start")  # fmt: skip
    args = smoke.parse_args(parser, {"rounds": 1, "ranks": "1"})
    if not cuda_in_child():
        smoke.skip_gpu("cuda_standby_probe", "the restarted worker's phases")
        return
    if args.guard:
        guard(1)
        return
    modes = args.modes.split(",")
    print(f"torch {torch.__version__}", flush=True)  # no CUDA call here: the children fork
    topo_dir = tempfile.mkdtemp(prefix="probe-nccl-topo-")
    try:
        measure(args, modes, topo_dir)
    finally:
        shutil.rmtree(topo_dir, ignore_errors=True)


def measure(args: argparse.Namespace, modes: list[str], topo_dir: str) -> None:
    for world in (int(n) for n in args.ranks.split(",")):
        TOPO_FILES.update(NCCL_TOPO_FILE=f"{topo_dir}/topo-{world}.xml",
                          NCCL_GRAPH_FILE=f"{topo_dir}/graph-{world}.xml")  # fmt: skip
        seen: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for round_ in range(args.rounds):
            for mode in modes:
                t = one_round(world, mode, args.store)
                seen[mode].append(t)
                cells = " ".join(f"{p}={t[p]:.3f}" for p in PHASES)
                print(f"ranks={world} store={args.store} round={round_} mode={mode} {cells}",
                      flush=True)  # fmt: skip
        for mode in modes:
            med = {p: statistics.median(t[p] for t in seen[mode]) for p in PHASES}
            cells = " ".join(f"{p}={med[p]:.3f}" for p in PHASES)
            print(f"MEDIAN ranks={world} store={args.store} mode={mode} {cells}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
