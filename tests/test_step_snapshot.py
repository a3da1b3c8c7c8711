"""`StepSnapshot` in one process (no launcher, no process group): the overlapped save, its
fence, the skip rule, and a restore into a fresh model and optimizer that is bit-equal."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from ftrun.checkpointing import StepSnapshot
from ftrun.checkpointing import part_write as part_write_module
from ftrun.checkpointing.errors import CheckpointUsageError
from ftrun.checkpointing.snapshot import default_directory


def trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = [t.clone() for t in model.state_dict().values()]
    return found + [v.clone() for s in optimizer.state.values() for v in s.values()]


def test_a_fresh_process_restores_the_newest_step_bit_equal_and_goes_on_the_same(tmp_path: Path):
    model, optimizer = trainer()
    snapshot = StepSnapshot(tmp_path)
    expected = {}
    for step in range(1, 8):
        train_step(model, optimizer, step)
        assert snapshot.save({"model": model, "optimizer": optimizer, "step": step}, step)
        expected[step] = tensors(model, optimizer)
        snapshot.wait()  # else the next save may find this one still running, and skip
    snapshot.close()
    model2, optimizer2 = trainer()  # a new process: a new model, an optimizer without state
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    assert StepSnapshot(tmp_path).restore(state) == 7 and state["step"] == 7
    assert same(tensors(model2, optimizer2), expected[7])
    train_step(model2, optimizer2, 8)
    train_step(model, optimizer, 8)
    assert same(tensors(model2, optimizer2), tensors(model, optimizer))


def test_saves_after_the_first_and_after_a_restore_write_into_memory_made_ahead(tmp_path: Path):
    """No save but a process's first waits for new memory: the files the saves rotate
    through are made in the background after it, or after a restore; every later part is
    one of them."""
    model, optimizer = trainer()
    state = {"model": model, "optimizer": optimizer}
    for life in range(2):
        snapshot = StepSnapshot(tmp_path)
        start = snapshot.restore(state)
        snapshot.wait()  # the memory made after the restore (the second life)
        files = {p.stat().st_ino for p in tmp_path.glob("step-snapshots/.recycled-*")}
        inodes = set()
        for step in range(start + 1, start + 7):
            train_step(model, optimizer, step)
            assert snapshot.save(state, step)
            snapshot.wait()
            if life or step > 1:  # the first life's first part is a file of its own
                inodes.add(next(tmp_path.glob(f"step-snapshots/iter_*{step}/*")).stat().st_ino)
        assert len(inodes) == 3 and (not life or inodes == files), life
        snapshot.close()


def test_nothing_saved_restores_step_zero_and_leaves_the_state(tmp_path: Path):
    model, optimizer = trainer()
    before = tensors(model, optimizer)
    assert StepSnapshot(tmp_path).restore({"model": model, "optimizer": optimizer}) == 0
    assert same(tensors(model, optimizer), before)


def test_every_k_saves_only_due_steps(tmp_path: Path):
    model, _ = trainer()
    snapshot = StepSnapshot(tmp_path, every=3)
    taken = []
    for step in range(1, 8):
        taken += [step] if snapshot.save({"model": model}, step) else []
        snapshot.wait()
    assert taken == [3, 6] and snapshot.taken == 2 and snapshot.skipped == 0
    with pytest.raises(CheckpointUsageError):
        StepSnapshot(tmp_path, every=0)


def test_a_save_still_copying_makes_the_next_skip_and_the_optimizer_step_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The copies happen in the background: while they run, the next save is skipped (the
    training never waits for node memory), and an optimizer step waits for them (it would
    change the tensors being copied)."""
    gate, copying = threading.Event(), threading.Event()
    real = part_write_module._copy_into

    def held(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        copying.set()
        assert gate.wait(30)
        real(dst, src, non_blocking)

    monkeypatch.setattr(part_write_module, "_copy_into", held)
    model, optimizer = trainer()
    snapshot = StepSnapshot(tmp_path)
    train_step(model, optimizer, 1)
    assert snapshot.save({"model": model, "optimizer": optimizer}, 1)
    assert copying.wait(30)
    assert not snapshot.save({"model": model, "optimizer": optimizer}, 2)
    assert snapshot.skipped == 1
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (train_step(model, optimizer, 2), stepped.set()))
    stepper.start()
    assert not stepped.wait(0.3)  # held by the fence: the copy has not finished
    gate.set()
    stepper.join(30)
    assert stepped.is_set()
    snapshot.close()
    assert StepSnapshot(tmp_path).restore({"model": trainer()[0]}) == 1


def test_fsdp2_shards_are_saved_as_local_tensors_and_restored_into_them(tmp_path: Path):
    """FSDP2 (one gloo rank): DTensor parameters and optimizer moments go to the part as their
    local shards and come back into a fresh model's, its optimizer given state first."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:

        def sharded() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            model, _ = trainer()
            fully_shard(model)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

        model, optimizer = sharded()
        snapshot = StepSnapshot(tmp_path / "snap")
        for step in range(1, 4):
            train_step(model, optimizer, step)
            snapshot.save({"model": model, "optimizer": optimizer}, step)
            snapshot.wait()
        snapshot.close()
        local = [t.to_local().clone() for t in tensors(model, optimizer) if hasattr(t, "to_local")]
        model2, optimizer2 = sharded()
        assert (
            StepSnapshot(tmp_path / "snap").restore({"model": model2, "optimizer": optimizer2}) == 3
        )
        again = [t.to_local() for t in tensors(model2, optimizer2) if hasattr(t, "to_local")]
        assert local and same(again, local)
    finally:
        dist.destroy_process_group()


def test_the_default_directory_is_this_users_0700_and_refuses_anything_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/1")
    made = default_directory(tmp_path)
    assert made == tmp_path / f"ftrun-snapshots-{os.getuid()}" / "job_1"
    assert made.stat().st_mode & 0o777 == 0o700
    made.chmod(0o755)  # another user could read the state
    with pytest.raises(CheckpointUsageError, match="not a 0700 directory"):
        default_directory(tmp_path)
    made.rmdir()
    made.symlink_to(tmp_path)  # a link planted in its place
    with pytest.raises(CheckpointUsageError, match="not a 0700 directory"):
        default_directory(tmp_path)


PEER_RESTORE = """
import sys, hashlib, torch, torch.distributed as dist
from ftrun.checkpointing import StepSnapshot
dist.init_process_group("gloo")
rank, snap = dist.get_rank(), sys.argv[1]

def trainer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

def digest(model, optimizer):
    found = [*model.state_dict().values()]
    found += [v for s in optimizer.state.values() for v in s.values()]
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in found)).hexdigest()[:16]

model, optimizer = trainer(0)  # the same on both ranks, as under DDP
snapshot = StepSnapshot(snap)
for step in range(1, 4):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    optimizer.param_groups[0]["lr"] = 0.1 * step  # a scheduler's doing: not a tensor
    if rank == 0 or step == 1:  # rank 1 lost its newer snapshots (a replaced node's rank)
        snapshot.save({"model": model, "optimizer": optimizer}, step)
        snapshot.wait()
snapshot.close()
trained = digest(model, optimizer)
fresh, fresh_optimizer = trainer(1 + rank)
state = {"model": fresh, "optimizer": fresh_optimizer}
alone = StepSnapshot(snap).restore(state)  # no step every rank holds
step = StepSnapshot(snap).restore(state, replicated=True)
print(alone, step, trained, digest(fresh, fresh_optimizer), fresh_optimizer.param_groups[0]["lr"])
dist.destroy_process_group()
"""


def test_a_replicated_state_comes_from_the_peer_holding_the_newest_step(tmp_path: Path):
    """Rank 1 holds only step 1's snapshot, rank 0 steps 2 and 3: without `replicated` no step
    is held by both (0: from the start); with it, rank 0 reads step 3 and broadcasts it, and
    both ranks hold the trained state bit for bit, the optimizer's learning rate included."""
    from support import run_gloo_ranks

    lines = run_gloo_ranks(PEER_RESTORE, [str(tmp_path / "snap")], timeout=60)
    rows = [line.split() for line in lines]
    assert all(row[:2] == ["0", "3"] for row in rows), lines
    assert all(row[2] == row[3] == rows[0][2] for row in rows), lines
    assert all(float(row[4]) == pytest.approx(0.3) for row in rows), lines
