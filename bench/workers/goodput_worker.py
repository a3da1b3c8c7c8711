"""The goodput bench's training script: the plain transformer of `gpu_user_worker.py` (DDP,
AdamW, one fixed batch; 151M on a GPU by default), saved the way its setting says:

- `--save torch`: rank 0 `torch.save`s model + optimizer + step every `--ckpt-every` steps to
  `--out DIR/ckpt.pt`; every rank resumes from the file (the script people write);
- `--save snapshot`: `ftrun.checkpointing.StepSnapshot` every step (`--snapshot-every`),
  `restore` at start;
- `--save nvrx-local`: NVRx 0.7's `LocalCheckpointManager` (in /dev/shm, as its examples) every
  `--ckpt-every` steps, `is_async=True` through its `AsyncCallsQueue`, finalized each step
  (a due save is skipped while the previous one is still being written);
  `find_latest` + `load` at start. Its `BasicTensorAwareStateDict` takes CUDA tensors only, so
  AdamW's step counters go to the GPU in the saved copy (the one line a user adds);
- `--save none`: nothing (the script's own step time).

Lines (to `--out DIR/rank<R>.log`): `mark=ready from=<step>` once restored, `step=<n>` after each
step, `save=<s>` after each save with the seconds it held the step. A fault the bench asks for
by file: `DIR/raise-rank<R>` makes that rank raise at its next step (the file is removed).
Signals (SIGKILL, SIGSTOP) and lost nodes come from the bench itself. Under a launcher with a
rank monitor (`FTRUN_BENCH_CLIENT`), each life sends a heartbeat a step and, after 20 steps, sets
its heartbeat timeouts from what it saw (`calculate_and_set_hb_timeouts`), as NVRx's examples.
"""

import time

START_TS = time.time()

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_user_worker import Log, add_model_args, build_model, monitor_client  # noqa: E402

TIMEOUTS_AFTER = 20  # steps of each life before the heartbeat timeouts are calculated


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10**9)
    saves = ["torch", "snapshot", "nvrx-local", "none"]
    parser.add_argument("--save", choices=saves, default="torch")
    parser.add_argument("--snapshot-every", type=int, default=1, help="StepSnapshot's every")
    parser.add_argument("--pg-timeout", type=float, default=600, help="collective timeout, s")
    parser.add_argument("--out", type=Path, required=True)
    add_model_args(parser)
    return parser.parse_args()


def restore(args: argparse.Namespace, state: dict, path: Path, device: torch.device):
    """(the StepSnapshot or None, the step to resume after)."""
    if args.save == "snapshot":
        from ftrun.checkpointing import StepSnapshot

        snapshot = StepSnapshot(every=args.snapshot_every)
        return snapshot, snapshot.restore(state)
    if args.save == "nvrx-local":
        local = NVRxLocal(args.ckpt_every)
        return local, local.restore(state)
    if args.save == "torch" and path.exists():
        saved = torch.load(path, map_location=device)
        state["model"].load_state_dict(saved["model"])
        state["optimizer"].load_state_dict(saved["optimizer"])
        return None, saved["step"]
    return None, 0


class NVRxLocal:
    """NVRx 0.7's local checkpoints, as its `examples/checkpointing/local_ckpt.py` uses them."""

    def __init__(self, every: int) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict,
        )
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )

        root = Path("/dev/shm") / f"nvrx-local-{os.environ['TORCHELASTIC_RUN_ID']}"
        self.manager = LocalCheckpointManager(root)
        self.queue, self.wrap, self.every = AsyncCallsQueue(), BasicTensorAwareStateDict, every

    def restore(self, state: dict) -> int:
        iteration = self.manager.find_latest()
        if iteration == -1:
            return 0
        loaded, _ = self.manager.load()
        state["model"].load_state_dict(loaded.state_dict["model"])
        state["optimizer"].load_state_dict(loaded.state_dict["optimizer"])
        return iteration

    def save(self, state: dict, step: int) -> bool:
        self.queue.maybe_finalize_async_calls(blocking=False)
        # A save still being written: skip this one, as StepSnapshot does. Queuing it would
        # pile saves up behind the writer (1.7 GB each), and none would be finalized in time.
        if step % self.every or self.queue.get_num_unfinalized_calls():
            return False
        optimizer = state["optimizer"].state_dict()
        # New containers: NVRx replaces the tensors in them with CPU copies, in place.
        optimizer["state"] = {
            index: {**per_param, "step": per_param["step"].cuda()}
            for index, per_param in optimizer["state"].items()
        }
        payload = {"model": state["model"].state_dict(), "optimizer": optimizer}
        request = self.manager.save(self.wrap(payload), step, is_async=True)
        self.queue.schedule_async_request(request)
        return True


def main() -> None:
    args = parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    log = Log(rank, args.out)
    cuda = args.device == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = build_model(args).to(device)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    state = {"model": model, "optimizer": optimizer}
    path = args.out / "ckpt.pt"  # the run's own directory
    snapshot, start = restore(args, state, path, device)
    gen = torch.Generator().manual_seed(1234 + rank)
    data = torch.randn(args.batch, args.seq, args.d_model, generator=gen).to(device)
    target = torch.randn(args.batch, args.seq, args.d_model, generator=gen).to(device)
    client, _ = monitor_client()
    log(f"mark=ready from={start}")
    trigger = args.out / f"raise-rank{rank}"
    for step in range(start + 1, args.steps + 1):
        if trigger.exists():
            trigger.unlink()
            raise RuntimeError(f"injected exception at step {step}")
        loss = nn.functional.mse_loss(ddp(data), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()
        if client is not None:
            client.send_heartbeat()
            if step == start + TIMEOUTS_AFTER:  # as NVRx's examples: timeouts from what was seen
                client.calculate_and_set_hb_timeouts()
        log(f"step={step}")
        saved_at = time.perf_counter()
        if snapshot is not None and snapshot.save(state, step):
            log(f"save={time.perf_counter() - saved_at:.6f}")
        elif args.save == "torch" and step % args.ckpt_every == 0:
            if rank == 0:
                checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**checkpoint, "step": step}, f"{path}.tmp")
                os.replace(f"{path}.tmp", path)
            log(f"save={time.perf_counter() - saved_at:.6f}")


if __name__ == "__main__":
    main()
