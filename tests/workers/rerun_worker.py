"""A gloo rank whose training loop uses ftrun.rerun, as Megatron-Core's does.

One scalar weight w, SGD; rank r's batch at step s is x = 1 + 0.01 s + 0.1 r and the loss is
(w x - 2 x)^2; gradients are averaged over the ranks (all_reduce), so the run is deterministic
and a test can compute every loss. Each step appends "<cycle> <step> <loss> <w> <time>" to
<ckpt-dir>/progress-rank<R>.txt (the loss the step went on with).

--flip MODE:STEP[,MODE:STEP...] multiplies by 1000 the loss of the rank named in
<ckpt-dir>/flip-rank (the test writes it once it knows the nodes, then <ckpt-dir>/flip-armed, which
every rank waits for at that step) at each STEP; `validate_result` rejects a loss above 100.
MODE: `once` (the first run of the step only: a transient fault), `marked` (on a
node the test marked, <ckpt-dir>/fail-<FTRUN_NODE>: a bad node), `always` (wherever it runs: a
correct but unexpected result). A checkpoint for a re-run elsewhere goes through ftrun's local
tier (replicated to the next node); a restarted rank resumes from it. `--device cuda`: NCCL,
the weight on the rank's GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun.checkpointing import CliqueReplicationStrategy, LocalCheckpointManager
from ftrun.rerun import RerunDataIterator, RerunMode, RerunState, initialize_rerun_state_machine

CYCLE = int(os.environ.get("FTRUN_CYCLE", "0"))
ARM_TIMEOUT_S = 60.0
NODE = os.environ.get("FTRUN_NODE", "")


def batches(rank: int, start: int):
    step = start
    while True:
        step += 1
        yield torch.tensor([1.0 + 0.01 * step + 0.1 * rank])


def flip_rank(ckpt_dir: Path) -> int:
    """The rank to flip, once the test has decided it (`flip-armed`; bounded wait)."""
    deadline = time.monotonic() + ARM_TIMEOUT_S
    while not (ckpt_dir / "flip-armed").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rerun_worker: no flip-armed in {ckpt_dir} within {ARM_TIMEOUT_S}s")
        time.sleep(0.01)
    return int((ckpt_dir / "flip-rank").read_text())


def join_group(kind: str) -> torch.device:
    """The rank's device (`cuda:LOCAL_RANK`, or the CPU) and its process group (NCCL, gloo)."""
    device = torch.device("cpu")
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--flip", default="", metavar="MODE:STEP[,MODE:STEP...]")
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--fatal", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    device = join_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    flips = {int(s): m for m, s in (f.split(":") for f in args.flip.split(",") if f)}
    local = LocalCheckpointManager(
        args.ckpt_dir / "local",
        repl_strategy=CliqueReplicationStrategy.from_replication_params(
            replication_jump=int(os.environ["LOCAL_WORLD_SIZE"]), replication_factor=2
        ),
        persist_to_disk=False,
    )
    rsm = initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    w = torch.nn.Parameter(torch.tensor([1.0], device=device))
    optim = torch.optim.SGD([w], lr=0.01)
    start = 0
    if local.find_latest() >= 0:
        state, _ = local.load()
        w.data.copy_(state["w"])
        rsm.load_state_dict(state["rerun"])
        start = int(state["step"])
        print(f"rank {rank}: resumed after step {start} in state {rsm.state.name}", flush=True)
    # The loader resumes after the step to re-run: the state machine replays that step's batch.
    replayed = 1 if rsm.state is RerunState.WILL_RERUN_FROM_CHECKPOINT else 0
    data = RerunDataIterator(batches(rank, start + replayed))
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    progress = (args.ckpt_dir / f"progress-rank{rank}.txt").open("a")
    for step in range(start + 1, args.steps + 1):
        while rsm.should_run_forward_backward(data):
            optim.zero_grad()
            x = next(data).to(device)
            loss = ((w * x - 2 * x) ** 2).sum()
            flip = step in flips and rank == flip_rank(args.ckpt_dir) and (
                flips[step] == "always"
                or (flips[step] == "marked" and (args.ckpt_dir / f"fail-{NODE}").exists())
                or (flips[step] == "once" and rsm.state is RerunState.INITIAL_RUN and CYCLE == 0)
            )  # fmt: skip
            if flip:  # a wrong result: its gradient would throw the weight far off
                loss = loss * 1000.0
            rsm.validate_result(loss.detach(), lambda v: float(v) > 100.0, "loss spike",
                                fatal=args.fatal)  # fmt: skip
            loss.backward()
        checkpoint, exit_now, code = rsm.should_checkpoint_and_exit()
        if checkpoint:
            local.save({"w": w.detach().clone(), "step": step - 1,
                        "rerun": rsm.state_dict(data)}, iteration=step)  # fmt: skip
        if exit_now:
            print(f"rank {rank}: exiting {code} at step {step}", flush=True)
            sys.stdout.flush()
            os._exit(code)
        assert w.grad is not None
        dist.all_reduce(w.grad)
        w.grad /= world
        optim.step()
        progress.write(f"{CYCLE} {step} {float(loss):.9g} {float(w):.9g} {time.time():.6f}\n")
        progress.flush()
        time.sleep(args.step_time)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
