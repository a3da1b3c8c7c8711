"""A small real DDP training (gloo) that uses every part of ftrun's worker-side API.

Run it under `ft_launcher` (see README). It:
- reports progress to the rank monitor: a "step" section around each step and a heartbeat after,
- checkpoints every --save-every steps (rank 0 writes, atomically), on SIGTERM, and at the end,
  saving the monitor's calculated timeouts with the model,
- resumes from the latest checkpoint, so a restart or a relaunch never goes back past it,
- appends "<cycle> <step> <time>" to <ckpt-dir>/progress-rank<R>.txt after every step,
- with --local-ckpt-every N, also saves each rank's own part every N steps with
  `ftrun.checkpointing.LocalCheckpointManager` (node memory under ft_launcher, kept by the agent
  and replicated to the next node; <ckpt-dir>/local under torchrun), and resumes from it when it
  is newer than the global checkpoint,
- writes <ckpt-dir>/FINISHED when training is complete: the Slurm wiring reads it to decide
  not to relaunch a finished job.
- exits at once (`os._exit`) when a step raises, typically because a peer died, instead of
  spending seconds in torch's interpreter teardown while every node waits to restart: on the
  launcher's SIGTERM if it comes within 0.5 s (so the launcher blames the rank that failed
  first), else with code 1.

Faults for demos and tests (each fires once, in the given cycle): --crash CYCLE:RANK:STEP exits
with code 1; --hang CYCLE:RANK:STEP stops inside the "step" section (sleeps);
--hang-collective CYCLE:RANK:STEP sleeps before all_reduce so the others block inside gloo.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ftrun.checkpointing import CliqueReplicationStrategy, LocalCheckpointManager
from ftrun.client_lib import RankMonitorClient
from ftrun.gloo_exit import wait_gloo_idle

CYCLE = int(os.environ.get("FTRUN_CYCLE", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
RANK = int(os.environ.get("RANK", "0"))
_stop_requested = False
_terminated = threading.Event()
# How long a rank whose step raised waits for the launcher's SIGTERM before exiting 1 itself.
PEER_FAILURE_WAIT_S = 0.5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.02, help="extra seconds per step")
    parser.add_argument("--crash", default="", metavar="CYCLE:RANK:STEP")
    parser.add_argument("--hang", default="", metavar="CYCLE:RANK:STEP")
    parser.add_argument("--hang-collective", default="", metavar="CYCLE:RANK:STEP")
    parser.add_argument("--calc-timeouts-at", type=int, default=0, help="step; 0 = never")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL")
    parser.add_argument("--ballast-mb", type=int, default=0, help="extra device memory to hold")
    parser.add_argument(
        "--local-ckpt-every", type=int, default=0, metavar="N",
        help="also save each rank's part every N steps with ftrun.checkpointing (0: off)",
    )  # fmt: skip
    parser.add_argument("--sigterm-grace", type=float, default=3.0, help="seconds to checkpoint")
    return parser.parse_args()


def fault_here(spec: str, step: int) -> bool:
    if not spec:
        return False
    cycle, rank, at = (int(x) for x in spec.split(":"))
    return (cycle, rank, at) == (CYCLE, RANK, step)


def hang_in_step() -> None:
    time.sleep(3600)


def sleep_before_all_reduce() -> None:
    time.sleep(3600)


def watch_sigterm(grace: float) -> None:
    """SIGTERM asks for a checkpoint at the next step; if none comes within `grace`, exit.

    A Python handler alone would only run once the main thread leaves C++, and a rank blocked
    in a collective whose peer died never does; then no checkpoint is possible and holding on
    only delays the restart. So the handler is a no-op and the work is done by a thread woken
    through `set_wakeup_fd`: the C-level handler writes the signal number to a pipe in whichever
    thread the kernel picked (torch's and OpenMP's threads included).
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def wait_for_term() -> None:
        global _stop_requested
        while os.read(read_fd, 1) != bytes([signal.SIGTERM]):
            pass  # another signal with a Python handler
        _stop_requested = True
        _terminated.set()
        time.sleep(grace)
        os._exit(143)

    threading.Thread(target=wait_for_term, name="sigterm", daemon=True).start()


def setup_device(kind: str) -> torch.device:
    """gloo on the CPU, or NCCL with one GPU per local rank."""
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def train_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    args: argparse.Namespace,
    step: int,
    device: torch.device,
) -> None:
    if fault_here(args.crash, step):
        print(f"rank {RANK}: injected crash at step {step}", flush=True)
        os._exit(1)
    if fault_here(args.hang, step):
        print(f"rank {RANK}: injected hang at step {step}", flush=True)
        hang_in_step()
    loss = model(torch.randn(32, 16, device=device)).pow(2).mean()
    optim.zero_grad()
    if fault_here(args.hang_collective, step):
        sleep_before_all_reduce()
    loss.backward()  # DDP's all_reduce happens here
    optim.step()
    time.sleep(args.step_time)


def save(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-save never leaves a torn checkpoint


def local_checkpoints(args: argparse.Namespace) -> LocalCheckpointManager | None:
    """Each rank's own part, frequent: in node memory under ft_launcher (kept by the agent,
    replicated to the next node), in <ckpt-dir>/local under torchrun."""
    if not args.local_ckpt_every:
        return None
    # A rank's copy goes to the rank one node further (jump = ranks per node): a lost node's
    # parts then live on its neighbour.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    clique = CliqueReplicationStrategy.from_replication_params(
        replication_jump=per_node, replication_factor=2
    )
    return LocalCheckpointManager(args.ckpt_dir / "local", repl_strategy=clique)


def resume(
    ckpt: Path,
    local: LocalCheckpointManager | None,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    client: RankMonitorClient,
    device: torch.device,
) -> int:
    """Load the newest checkpoint, global or local; the step it holds (0: none)."""
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True, map_location=device)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        client.load_state_dict(state["monitor"])
        start = state["step"]
    if local is not None and local.find_latest() > start:  # newer than the global checkpoint
        # Read straight into the model's tensors (checked as they land): one pass, no copy.
        into = {"model": model.state_dict(), "optim": optim.state_dict()}
        state, ckpt_id = local.load(into=into)
        optim.load_state_dict(state["optim"])  # its hyper-parameters come from the checkpoint
        start = state["step"]
        print(f"rank {RANK}: resumed from local checkpoint {ckpt_id.iteration}", flush=True)
    return start


def main() -> int:
    args = parse_args()
    watch_sigterm(args.sigterm_grace)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt_dir / "checkpoint.pt"
    device = setup_device(args.device)
    torch.manual_seed(0)
    ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(nn.Linear(16, 1).to(device), device_ids=ids)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    ballast = torch.empty(args.ballast_mb * 2**20, dtype=torch.uint8, device=device)  # noqa: F841
    client = RankMonitorClient()
    local = local_checkpoints(args)
    start = resume(ckpt, local, model.module, optim, client, device)
    client.init_workload_monitoring()
    progress = (args.ckpt_dir / f"progress-rank{RANK}.txt").open("a")

    def checkpoint(step: int) -> None:
        if RANK == 0:
            save(
                ckpt,
                {
                    "model": model.module.state_dict(),
                    "optim": optim.state_dict(),
                    "step": step,
                    "monitor": client.state_dict(),
                },
            )
        dist.barrier()

    step = start
    for step in range(start + 1, args.steps + 1):
        client.start_section("step")
        train_step(model, optim, args, step, device)
        client.end_section("step", iteration=step)
        client.send_heartbeat(iteration=step)
        progress.write(f"{CYCLE} {step} {time.time():.6f}\n")
        progress.flush()
        if step == args.calc_timeouts_at:
            client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
            client.calculate_and_set_section_timeouts(skip_if_not_ready=True)
        stop = torch.tensor([1 if _stop_requested else 0], device=device)
        dist.all_reduce(stop)  # everyone agrees to stop at the same step
        if stop.item() or step % args.save_every == 0:
            checkpoint(step)
        elif local is not None and step % args.local_ckpt_every == 0:
            part = {"model": model.module.state_dict(), "optim": optim.state_dict(), "step": step}
            local.save(part, step, is_async=True)  # blocks only for the copy into node memory
        if stop.item():
            print(f"rank {RANK}: stopping on request at step {step}, checkpoint saved", flush=True)
            break
    else:
        checkpoint(step)
        if RANK == 0:
            (args.ckpt_dir / "FINISHED").write_text(f"{step}\n")
        print(f"rank {RANK}: training finished at step {step}", flush=True)
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()
    # DDP holds the last reference to the gloo group: freed as main() returns, its destructor
    # joins gloo's threads under the GIL, and one still freeing a finished collective needs the
    # GIL (a deadlock on a loaded node). Let them finish, then free it here.
    wait_gloo_idle()
    model = None  # the closure `checkpoint` shares this variable: `del` would trip linters
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        # Nearly always a collective failing because a peer died: there is nothing left to
        # save, and torch's interpreter teardown can take seconds that the restart waits for.
        # The launcher's SIGTERM usually follows within its monitor interval; leaving on it
        # (143, "stopped") rather than with 1 keeps the blame on the rank that failed first.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(143 if _terminated.wait(PEER_FAILURE_WAIT_S) else 1)
