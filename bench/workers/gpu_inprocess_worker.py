"""gpu_user_worker.py's training, wrapped for in-process restart: ftrun's wrapper or NVRx's.

The same 151M transformer, AdamW, DDP over NCCL (gloo with `--device cpu`), `torch.save` every
`--ckpt-every` steps and `--compile`, arranged as NVRx's advanced example arranges its script:
what does not depend on a process group (the model on its device, `torch.compile` of it, the
optimizer, a TCPStore at MASTER_PORT + 2) is built once, outside the wrapped function; the
process group (on a PrefixStore per restart iteration) and DDP are built inside it, and each
call loads the newest checkpoint (`--restore disk`, as NVRx's examples do), or, with `--restore
snapshot`, `ftrun.checkpointing.StepSnapshot`'s of every step, in node memory (a replaced rank's
new process reads it there too); `--restore peer` is the same restored with `replicated=True`: a
rank without the newest snapshot takes it from a rank that has one, over the new process group
(DDP's ranks hold the same state: a broadcast over NVLink instead of an older step).
`--init-on-device` builds the model directly on the GPU instead of on the CPU and then moving
it (a new process's start-up). `--wrapper ftrun|nvrx` picks the import, and nothing else differs:

    import ftrun.inprocess as inprocess                      # --wrapper ftrun
    import nvidia_resiliency_ext.inprocess as inprocess      # --wrapper nvrx

with NVRx's example's arguments for both: `store_kwargs={"port": MASTER_PORT + 1}` and
`health_check=CudaHealthCheck()` on a GPU.

One fault per job, in rank `--fault-rank` at `--fault-step`, once (a marker file in the
checkpoint directory): `raise` (a RuntimeError), `kill` (SIGKILL of the rank's own process),
`abort-hang` (a RuntimeError, with this rank's `ProcessGroupNCCL.abort` made to hang: an NCCL
abort that never returns). The lines are gpu_user_worker.py's, with the restart iteration:

    <wall clock s> rank=<r> pid=<pid> mark=start|cuda [proc=<process start>]
    <wall clock s> rank=<r> pid=<pid> mark=enter|pg|load|ddp|ready it=<iteration> [from=<step>]
    <wall clock s> rank=<r> pid=<pid> step=<n> it=<iteration> loss=<x>
    <wall clock s> rank=<r> pid=<pid> step=<n> it=<iteration> fault=raise|kill|abort-hang

SIGUSR1 writes every thread's stack to `--out`/stack-rank<r>-<pid>.txt (the bench sends it to
a job that runs past its time before killing it).
"""

import time

START_TS = time.time()  # the script's first line

import argparse  # noqa: E402 (after the start time)
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")  # NVRx's advice: its store waits warn
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpu_user_worker import (  # noqa: E402
    CKPT_NAME,
    Log,
    add_model_args,
    build_model,
    process_start,
)
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from ftrun.gloo_exit import wait_gloo_idle  # noqa: E402 (either wrapper: a torch bug)

WRAPPERS = {"ftrun": "ftrun.inprocess", "nvrx": "nvidia_resiliency_ext.inprocess"}
FAULTS = ("none", "raise", "kill", "abort-hang")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", choices=list(WRAPPERS), required=True)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=25, help="train this many steps in all")
    parser.add_argument("--restore", choices=["disk", "peer", "snapshot"], default="disk",
                        help="where a restart gets the last checkpoint's state")  # fmt: skip
    parser.add_argument(
        "--init-on-device",
        action="store_true",
        help="build the model on its device, not on the CPU, then moved",
    )
    add_model_args(parser)
    parser.add_argument("--out", type=Path, help="also append the lines to DIR/rank<RANK>.log")
    return parser.parse_args()


ARGS = parse_args()
inprocess = importlib.import_module(WRAPPERS[ARGS.wrapper])  # the one line that differs
if ARGS.wrapper == "ftrun":  # its restart's split, one line per rank (the bench reads them)
    logging.getLogger("ftrun.inprocess").setLevel(logging.INFO)
    logging.getLogger("ftrun.inprocess").addHandler(logging.StreamHandler())


def inject_fault(rank: int, step: int, it: int, log: Log) -> None:
    """The job's one fault, if this rank and step are its place and it has not happened."""
    if ARGS.fault == "none" or rank != ARGS.fault_rank or step != ARGS.fault_step:
        return
    try:
        (ARGS.ckpt_dir / "fault.done").open("x").close()
    except FileExistsError:
        return
    log(f"step={step} it={it} fault={ARGS.fault}")
    if ARGS.fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if ARGS.fault == "abort-hang":
        dist.ProcessGroupNCCL.abort = _hang  # what an NCCL abort stuck in the driver looks like
    raise RuntimeError(f"injected fault at step {step} on rank {rank}")


def _hang(*_args: object) -> None:
    time.sleep(3600)


STEP_SNAPSHOT = None
if ARGS.restore in ("snapshot", "peer"):  # imported only here: the file mode's start-up as it was
    from ftrun.checkpointing import StepSnapshot

    STEP_SNAPSHOT = StepSnapshot()


def train(
    base_store: dist.Store,
    model: nn.Module,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    log: Log,
    call_wrapper: inprocess.CallWrapper | None = None,
) -> None:
    """One restart iteration: process group, checkpoint, DDP, the loop."""
    it = call_wrapper.iteration
    log(f"mark=enter it={it}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, timeout = ("nccl", 150) if device.type == "cuda" else ("gloo", 30)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(str(it), base_store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    log(f"mark=pg it={it}")
    ckpt_path = ARGS.ckpt_dir / CKPT_NAME
    start_step = 0
    restored = None
    if STEP_SNAPSHOT is not None:
        state = {"model": model, "optimizer": optimizer}
        restored = STEP_SNAPSHOT.restore(state, replicated=ARGS.restore == "peer") or None
    if restored is not None:
        start_step = restored
    elif ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        del state
    log(f"mark=load it={it}")
    ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    log(f"mark=ddp it={it}")
    gen = torch.Generator().manual_seed(1234 + rank)
    data = torch.randn(ARGS.batch, ARGS.seq, ARGS.d_model, generator=gen).to(device)
    target = torch.randn(ARGS.batch, ARGS.seq, ARGS.d_model, generator=gen).to(device)
    log(f"mark=ready it={it} from={start_step}")
    for step in range(start_step + 1, ARGS.steps + 1):
        inject_fault(rank, step, it, log)
        loss = nn.functional.mse_loss(ddp(data), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()  # waits for the step on the device
        call_wrapper.ping()
        log(f"step={step} it={it} loss={value:.5f}")
        if STEP_SNAPSHOT is not None:
            STEP_SNAPSHOT.save({"model": model, "optimizer": optimizer}, step)
        if ARGS.ckpt_every and step % ARGS.ckpt_every == 0:
            with call_wrapper.atomic():
                save(model, optimizer, step, rank, ckpt_path)
    dist.barrier()  # no rank tears its group down while a peer still uses it (gloo)
    dist.destroy_process_group()
    # DDP holds the last reference to a gloo group: freed with this frame, its destructor can
    # deadlock with a gloo worker thread (ftrun.gloo_exit says how); let them go quiet first.
    wait_gloo_idle()
    ddp = None  # dropped here, not in the frame's teardown


def save(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, path: Path
) -> None:
    """A checkpoint step: rank 0 writes the file."""
    if rank == 0:
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "step": step}  # fmt: skip
        torch.save(checkpoint, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


def main() -> None:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    log = Log(rank, ARGS.out)
    proc = process_start()
    log(f"mark=start proc={proc:.3f}" if proc else "mark=start", ts=START_TS)
    if ARGS.out is not None:
        stacks = (ARGS.out / f"stack-rank{rank}-{os.getpid()}.txt").open("w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    ARGS.ckpt_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu")
    if ARGS.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    if ARGS.init_on_device:
        with device:
            model = build_model(ARGS)
    else:
        model = build_model(ARGS).to(device)
    net = torch.compile(model) if ARGS.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=ARGS.lr)
    if device.type == "cuda":
        torch.cuda.synchronize()
    log("mark=cuda")
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world = int(os.environ["WORLD_SIZE"])
    base_store = dist.TCPStore(
        addr, port + 2, world, rank == 0, multi_tenant=True, wait_for_workers=True, use_libuv=True
    )
    kwargs: dict = {"store_kwargs": {"port": port + 1}}
    if device.type == "cuda":
        kwargs["health_check"] = inprocess.health_check.CudaHealthCheck()
    inprocess.Wrapper(**kwargs)(train)(base_store, model, net, optimizer, device, log)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
