"""A plain DDP training script for one GPU per rank, written the way people write them.

A 151M-parameter transformer stack (`nn.TransformerEncoder`: d_model 1024, 12 layers, feed-forward
4096) trained with AdamW on one fixed batch of random embeddings (seed 0, no data set), DDP over
NCCL (gloo with `--device cpu`); `torch.save` of model + optimizer + step every `--ckpt-every`
steps into `--ckpt-dir`, resumed with `torch.load` when the file is there; `--compile` wraps the
model in `torch.compile`. Errors propagate: no signal handlers, no `os._exit`. Run it under any
launcher:

    torchrun --standalone --nproc-per-node=1 bench/workers/gpu_user_worker.py --ckpt-dir /tmp/c
    ft_launcher --standalone --nproc-per-node=1 bench/workers/gpu_user_worker.py --ckpt-dir /tmp/c

With `FTRUN_BENCH_CLIENT=ftrun` (or `nvrx`) in the environment it reports to the launcher's rank
monitor through ftrun's (or NVRx's) `RankMonitorClient`: a `step` section around each step and a
heartbeat after it (the launcher must accept a `step` section: `--ft-rank-section-timeouts`).

Every line goes to stdout, flushed, and (with `--out DIR`) to `DIR/rank<RANK>.log`:

    <wall clock s> rank=<r> pid=<pid> mark=start proc=<process start, wall clock s>
    <wall clock s> rank=<r> pid=<pid> mark=torch|cuda|pg|load|ddp|opt|ready [from=<resumed step>]
    <wall clock s> rank=<r> pid=<pid> step=<n> loss=<x>
    <wall clock s> rank=<r> pid=<pid> step=<n> fault=crash          (right before the raise)

`mark=start`'s time is the script's first line. Crash injection stands for a user's bug: with
`--crash-at-step N` (repeatable) rank `--crash-rank` raises at step N once per job (a marker file
in the checkpoint directory remembers it), so `--crash-at-step 5 --crash-at-step 35` crashes at
step 5 in the first run, at step 35 in the restarted one, and the third run trains on from the
checkpoint of step 30.
"""

import time

START_TS = time.time()  # the script's first line

import argparse  # noqa: E402 (after the start time)
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

TORCH_TS = time.time()
CKPT_NAME = "ckpt.pt"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model, its training and its checkpoints: the same in the in-process worker."""
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ff", type=int, default=0, help="feed-forward width (0: 4 x d-model)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("ckpt"))
    parser.add_argument("--ckpt-every", type=int, default=10, help="0: no checkpoints")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="train this many steps in all")
    add_model_args(parser)
    parser.add_argument(
        "--crash-at-step",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="raise at step N, once per job (repeatable)",
    )
    parser.add_argument("--crash-rank", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also append the lines to DIR/rank<RANK>.log")
    return parser.parse_args()


class Log:
    """One flushed line per event, to stdout and (optionally) the rank's log file."""

    def __init__(self, rank: int, out: Path | None) -> None:
        self.who = f"rank={rank} pid={os.getpid()}"
        self.file = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.file = open(out / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115

    def __call__(self, text: str, ts: float | None = None) -> None:
        line = f"{time.time() if ts is None else ts:.6f} {self.who} {text}"
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")


def process_start() -> float | None:
    """This process's start (fork or exec) on the wall clock, 10 ms resolution: /proc's start
    time counts from boot, set against the boot-time clock now (/proc/stat's btime is whole
    seconds, too coarse)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError):
        return None


def monitor_client():
    """The launcher's RankMonitorClient (FTRUN_BENCH_CLIENT=ftrun|nvrx), or None."""
    kind = os.environ.get("FTRUN_BENCH_CLIENT", "none")
    if kind == "ftrun":
        from ftrun.client_lib import RankMonitorClient
    elif kind == "nvrx":
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    else:
        return None, kind
    client = RankMonitorClient()
    client.init_workload_monitoring()
    return client, kind


def build_model(args: argparse.Namespace) -> nn.Module:
    layer = nn.TransformerEncoderLayer(
        d_model=args.d_model,
        nhead=max(1, args.d_model // 64),
        dim_feedforward=args.ff or 4 * args.d_model,
        dropout=0.0,
        batch_first=True,
    )
    return nn.TransformerEncoder(layer, num_layers=args.layers, enable_nested_tensor=False)


def crash_due(args: argparse.Namespace, rank: int, step: int) -> Path | None:
    """The marker to leave if this rank crashes at this step now (once per job), else None."""
    if rank != args.crash_rank or step not in args.crash_at_step:
        return None
    marker = args.ckpt_dir / f"crash-at-{step}.done"
    return None if marker.exists() else marker


def setup(args: argparse.Namespace, log: Log, local_rank: int) -> dict:
    """Device, model, process group, checkpoint, DDP, optimizer: what the loop needs."""
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    torch.manual_seed(0)
    model = build_model(args).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    log("mark=cuda")

    dist.init_process_group(backend)
    log("mark=pg")

    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.ckpt_dir / CKPT_NAME
    state = torch.load(ckpt_path, map_location=device) if ckpt_path.exists() else None
    if state is not None:
        model.load_state_dict(state["model"])
    log("mark=load")
    # Compiled first, then wrapped (nanoGPT's order): DDP(compiled) compiles the transformer.
    net = torch.compile(model) if args.compile else model
    ddp = DDP(net, device_ids=[local_rank] if device.type == "cuda" else None)
    log("mark=ddp")
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    start_step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        del state
    log("mark=opt")
    return {"device": device, "model": model, "ddp": ddp, "optimizer": optimizer,
            "start_step": start_step, "ckpt_path": ckpt_path}  # fmt: skip


def report_step(client: object, step: int) -> None:
    if client is None:
        return
    client.end_section("step")
    if os.environ.get("FTRUN_BENCH_CLIENT") == "ftrun":
        client.send_heartbeat(iteration=step)
    else:
        client.send_heartbeat()


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    log = Log(rank, args.out)
    proc = process_start()
    log(f"mark=start proc={proc:.3f}" if proc else "mark=start", ts=START_TS)
    log("mark=torch", ts=TORCH_TS)
    run = setup(args, log, int(os.environ.get("LOCAL_RANK", "0")))
    model, ddp, optimizer = run["model"], run["ddp"], run["optimizer"]

    gen = torch.Generator().manual_seed(1234 + rank)
    data = torch.randn(args.batch, args.seq, args.d_model, generator=gen).to(run["device"])
    target = torch.randn(args.batch, args.seq, args.d_model, generator=gen).to(run["device"])
    client, _ = monitor_client()
    log(f"mark=ready from={run['start_step']}")

    for step in range(run["start_step"] + 1, args.steps + 1):
        if client:
            client.start_section("step")
        marker = crash_due(args, rank, step)
        if marker is not None:
            marker.touch()
            log(f"step={step} fault=crash")
            raise RuntimeError(f"injected crash at step {step}")
        loss = nn.functional.mse_loss(ddp(data), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()  # waits for the step on the device
        report_step(client, step)
        log(f"step={step} loss={value:.5f}")
        if rank == 0 and args.ckpt_every and step % args.ckpt_every == 0:
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "step": step}  # fmt: skip
            torch.save(checkpoint, f"{run['ckpt_path']}.tmp")
            os.replace(f"{run['ckpt_path']}.tmp", run["ckpt_path"])

    if client:
        client.shutdown_workload_monitoring()
    dist.barrier()  # no rank tears its group down while a peer still uses it (gloo aborts)
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
