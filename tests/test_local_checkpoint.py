"""LocalCheckpointManager over real files: save/find_latest/load, retention, async saves,
corrupt parts set aside, two gloo ranks agreeing, a full disk; and the replication arithmetic.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from ftrun.checkpointing import (
    BasicTensorAwareStateDict,
    CheckpointNotFoundError,
    CheckpointUsageError,
    CheckpointWriteError,
    CkptID,
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
    LocalCheckpointManager,
)
from ftrun.checkpointing.format import PartInfo, read_part
from ftrun.checkpointing.part_write import write_part
from ftrun.checkpointing.store import DirectoryStore, PartKey, PreparedPart
from support import run_gloo_ranks

WAIT_S = 10


@pytest.fixture(autouse=True)
def single_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def flip_last_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01
    path.write_bytes(bytes(blob))


def test_save_find_latest_load(tmp_path: Path) -> None:
    manager = LocalCheckpointManager(tmp_path, session_id="job7")
    assert manager.find_latest() == -1
    state = {"model": {"w": torch.randn(3, 4)}, "step": 10, "betas": (0.9, 0.99)}
    manager.save(state, 10)
    assert files(tmp_path) == ["job7", "job7/iter_0000010", "job7/iter_0000010/rank0-of1.ftckpt"]
    assert manager.find_latest() == 10
    loaded, ckpt_id = manager.load()
    assert ckpt_id == CkptID(10, 0, "job7")
    iteration, rank, session = ckpt_id  # unpacks like NVRx's tuple
    assert (iteration, rank, session) == (10, 0, "job7")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["betas"] == (0.9, 0.99) and loaded["step"] == 10


def test_parts_are_named_by_global_rank_and_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    LocalCheckpointManager(tmp_path).save({"x": 1}, 5)
    assert (tmp_path / "iter_0000005" / "rank3-of8.ftckpt").is_file()
    monkeypatch.setenv("WORLD_SIZE", "4")  # another world size: not this rank's part any more
    assert LocalCheckpointManager(tmp_path).find_latest() == -1


def test_a_wrapped_state_comes_back_wrapped(tmp_path: Path) -> None:
    manager = LocalCheckpointManager(tmp_path)
    manager.save(BasicTensorAwareStateDict({"w": torch.ones(2)}), 1)
    loaded, _ = manager.load()
    assert isinstance(loaded, BasicTensorAwareStateDict)
    assert torch.equal(loaded.state_dict["w"], torch.ones(2))
    manager.save({"w": torch.ones(2)}, 2)
    assert type(manager.load()[0]) is dict


def test_with_keep_complete_1_only_the_newest_complete_part_is_kept(tmp_path: Path) -> None:
    rolled_back = tmp_path / "iter_0000009" / "rank0-of1.ftckpt"
    rolled_back.parent.mkdir()
    write_part(rolled_back, {"x": 9}, 9)  # from a run that got further, then was rolled back
    crashed = tmp_path / "iter_0000002" / "rank0-of1.ftckpt.tmp-999999"
    crashed.parent.mkdir()
    crashed.write_bytes(b"half a part")
    other_rank = tmp_path / "iter_0000001" / "rank1-of2.ftckpt"
    other_rank.parent.mkdir()
    other_rank.write_bytes(b"not ours")
    (tmp_path / "iter_0000004").mkdir()  # a write that failed before its first byte
    manager = LocalCheckpointManager(tmp_path, keep_complete=1)
    for iteration in (1, 2, 3):
        manager.save({"x": iteration}, iteration)
    assert files(tmp_path) == [
        "iter_0000001",
        "iter_0000001/rank1-of2.ftckpt",
        "iter_0000003",
        "iter_0000003/rank0-of1.ftckpt",
    ]
    assert manager.load()[0] == {"x": 3}


def test_keep_complete_keeps_older_parts(tmp_path: Path) -> None:
    manager = LocalCheckpointManager(tmp_path, keep_complete=2)
    for iteration in (1, 2, 3):
        manager.save({"x": iteration}, iteration)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["iter_0000002", "iter_0000003"]


class GatedStore(DirectoryStore):
    """A directory store whose commits wait for `gate`: the test says when a background write
    may finish (and whether it fails)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.fail = False

    def prepare(self, key: PartKey, state: Any, metadata: Mapping[str, str]) -> PreparedPart:
        return GatedPart(super().prepare(key, state, metadata), self)


class GatedPart:
    def __init__(self, inner: PreparedPart, store: GatedStore) -> None:
        self.inner, self.store = inner, store

    def commit(self) -> PartInfo:
        opened = self.store.gate.wait(WAIT_S)
        if not opened or self.store.fail:
            self.inner.abort()
            raise CheckpointWriteError("the test failed this write")
        return self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


def test_async_save_returns_once_the_state_is_copied(tmp_path: Path) -> None:
    store = GatedStore(tmp_path)
    manager = LocalCheckpointManager(tmp_path, store=store, keep_complete=2)
    weights = torch.arange(1000, dtype=torch.float32)
    manager.save({"w": weights}, 1, is_async=True)
    final = store.path_of(PartKey(1, 0, 1))
    assert not final.exists(), "returned after the write instead of before it"
    assert [p.name for p in final.parent.iterdir()] == [f"{final.name}.tmp-{os.getpid()}"]
    weights.fill_(-1)  # the caller may change its tensors at once

    second_returned = threading.Event()

    def second_save() -> None:
        manager.save({"w": weights}, 2, is_async=True)
        second_returned.set()

    thread = threading.Thread(target=second_save)
    thread.start()
    assert not second_returned.wait(0.3), "a second save must wait for the first"
    store.gate.set()
    assert second_returned.wait(WAIT_S)
    thread.join(WAIT_S)
    assert manager.wait().iteration == 2
    first, _ = read_part(final)
    assert torch.equal(first["w"], torch.arange(1000, dtype=torch.float32))
    assert manager.load()[0]["w"].eq(-1).all()


def test_a_failed_async_save_is_raised_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = GatedStore(tmp_path)
    store.gate.set()
    store.fail = True
    manager = LocalCheckpointManager(tmp_path, store=store)
    manager.save({"x": 1}, 1, is_async=True)
    with pytest.raises(CheckpointWriteError, match="the test failed this write"):
        manager.wait()
    assert manager.wait() is None
    manager.save({"x": 2}, 2, is_async=True)
    with caplog.at_level(logging.ERROR):
        assert manager.find_latest() == -1  # find_latest logs the failure instead of raising
    assert "the background save failed" in caplog.text
    store.fail = False
    manager.save({"x": 3}, 3)
    assert files(tmp_path) == ["iter_0000003", "iter_0000003/rank0-of1.ftckpt"]


def test_a_corrupt_newest_part_is_set_aside_and_the_previous_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = LocalCheckpointManager(tmp_path, keep_complete=2)
    manager.save({"w": torch.full((64,), 1.0)}, 1)
    manager.save({"w": torch.full((64,), 2.0)}, 2)
    newest = tmp_path / "iter_0000002" / "rank0-of1.ftckpt"
    flip_last_byte(newest)
    assert manager.find_latest() == 2  # the header is fine: found by the header check
    with caplog.at_level(logging.WARNING):
        state, ckpt_id = manager.load()
    assert ckpt_id.iteration == 1 and state["w"].eq(1.0).all()
    assert "checksum mismatch in tensor t0" in caplog.text
    assert not newest.exists() and newest.with_name(newest.name + ".corrupt").exists()
    caplog.clear()
    assert manager.find_latest() == 1 and manager.load()[1].iteration == 1
    assert caplog.text == "", "a part set aside is never tried again"
    manager.save({"w": torch.full((64,), 3.0)}, 2)  # the same iteration, saved anew
    assert manager.find_latest() == 2 and manager.load()[0]["w"].eq(3.0).all()


def test_load_into_reads_into_the_models_own_tensors(tmp_path: Path) -> None:
    """In place, matched by path (not order), every dtype, the tied weight once; what the
    target lacks comes back new, and plain values come from the checkpoint."""
    manager = LocalCheckpointManager(tmp_path)
    tied = torch.randn(4, 3)
    saved = {
        "model": {"w": tied, "b": torch.arange(5, dtype=torch.bfloat16), "head": tied},
        "optim": [{"m": torch.randint(0, 9, (7,), dtype=torch.int64)}, (torch.ones(2, 2),)],
        "flags": torch.tensor([True, False]),
        "extra": torch.full((3,), 7.0),
        "step": 42,
    }
    manager.save(BasicTensorAwareStateDict(saved), 42)
    target = {
        "step": 0,
        "optim": [{"m": torch.zeros(7, dtype=torch.int64)}, (torch.zeros(2, 2),)],
        "model": {"head": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.bfloat16)},
        "flags": torch.zeros(2, dtype=torch.bool),
    }
    own = {
        "b": target["model"]["b"].data_ptr(),
        "m": target["optim"][0]["m"].data_ptr(),
        "head": target["model"]["head"].data_ptr(),
    }
    loaded, ckpt_id = manager.load(into=BasicTensorAwareStateDict(target))
    state = loaded.state_dict
    assert ckpt_id.iteration == 42 and state["step"] == 42
    assert (
        state["model"]["b"].data_ptr() == own["b"] and state["optim"][0]["m"].data_ptr() == own["m"]
    )
    assert state["model"]["head"].data_ptr() == own["head"]
    assert state["model"]["w"] is state["model"]["head"], "a tied weight is one tensor"
    for got, want in (
        (target["model"]["b"], saved["model"]["b"]),
        (target["model"]["head"], tied),
        (target["optim"][0]["m"], saved["optim"][0]["m"]),
        (target["optim"][1][0], saved["optim"][1][0]),
        (target["flags"], saved["flags"]),
        (state["extra"], saved["extra"]),  # not in the target: a new tensor
    ):
        assert torch.equal(got, want)


def test_an_optimizer_state_dict_round_trips_and_loads_into_a_new_optimizer(
    tmp_path: Path,
) -> None:
    """Its state is keyed by int (what `torch.save` users save first of all)."""

    def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(4, 3)
        optim = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        return model, optim

    model, optim = trained()
    manager = LocalCheckpointManager(tmp_path)
    manager.save({"model": model.state_dict(), "optim": optim.state_dict()}, 1)
    loaded, _ = manager.load()
    assert sorted(loaded["optim"]["state"]) == [0, 1]
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(loaded["optim"])
    other_model, other_optim = trained()
    manager.load(into={"model": other_model.state_dict(), "optim": other_optim.state_dict()})
    assert torch.equal(other_model.weight, model.weight)
    assert torch.equal(
        other_optim.state[other_model.weight]["exp_avg"], optim.state[model.weight]["exp_avg"]
    )


def test_load_into_falls_back_past_a_corrupt_part_and_refuses_a_wrong_shape(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = LocalCheckpointManager(tmp_path, keep_complete=2)
    manager.save({"w": torch.full((64,), 1.0)}, 1)
    manager.save({"w": torch.full((64,), 2.0)}, 2)
    flip_last_byte(tmp_path / "iter_0000002" / "rank0-of1.ftckpt")
    model = {"w": torch.zeros(64)}
    with caplog.at_level(logging.WARNING):
        _, ckpt_id = manager.load(into=model)
    assert ckpt_id.iteration == 1 and model["w"].eq(1.0).all()
    assert "checksum mismatch in tensor t0" in caplog.text
    with pytest.raises(CheckpointUsageError, match=r"is torch.float32 \[64\]; the target's is "):
        manager.load(into={"w": torch.zeros(65)})


def test_a_truncated_part_is_skipped_by_find_latest(tmp_path: Path) -> None:
    manager = LocalCheckpointManager(tmp_path, keep_complete=2)
    manager.save({"x": 1}, 1)
    manager.save({"x": 2}, 2)
    newest = tmp_path / "iter_0000002" / "rank0-of1.ftckpt"
    newest.write_bytes(newest.read_bytes()[:-1])
    assert manager.find_latest() == 1
    assert (tmp_path / "iter_0000002" / "rank0-of1.ftckpt.corrupt").exists()
    flip_last_byte(tmp_path / "iter_0000001" / "rank0-of1.ftckpt")
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint for rank 0 of 1"):
        manager.load()


def test_load_without_any_checkpoint_raises(tmp_path: Path) -> None:
    manager = LocalCheckpointManager(tmp_path / "never-created")
    assert manager.find_latest() == -1
    with pytest.raises(CheckpointNotFoundError):
        manager.load()


def test_bad_arguments_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CheckpointUsageError, match="session_id"):
        LocalCheckpointManager(tmp_path, session_id="a/b")
    with pytest.raises(CheckpointUsageError, match="keep_complete"):
        LocalCheckpointManager(tmp_path, keep_complete=0)
    manager = LocalCheckpointManager(tmp_path)
    with pytest.raises(CheckpointUsageError, match="iteration must be a non-negative int"):
        manager.save({}, -1)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(CheckpointUsageError, match=r"RANK=2 is not in 0\.\.WORLD_SIZE-1=0"):
        manager.save({}, 1)


TWO_RANKS = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
from ftrun.checkpointing import LocalCheckpointManager

root, rank = sys.argv[1], int(os.environ["RANK"])

def save(session, iterations):
    manager = LocalCheckpointManager(root, session, keep_complete=3)
    for it in iterations:
        manager.save({"it": it, "rank": rank, "w": torch.full((8,), float(it))}, it)
    return manager

# a: rank 1 died before finishing 3: both load 2.
a = save("a", [1, 2, 3] if rank == 0 else [1, 2])
# b: the minimum of the newest parts (2) is gone on rank 0: only 1 is common.
b = save("b", [1, 3] if rank == 0 else [1, 2])
# c: rank 1's part of 2 is damaged (found only when loading): both go back to 1.
c = save("c", [1, 2])
if rank == 1:
    path = os.path.join(root, "c", "iter_0000002", "rank1-of2.ftckpt")
    blob = bytearray(open(path, "rb").read()); blob[-1] ^= 1; open(path, "wb").write(blob)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
out = {}
for name, manager in (("a", a), ("b", b), ("c", c)):
    latest = manager.find_latest()
    state, ckpt_id = manager.load()
    out[name] = [latest, ckpt_id.iteration, state["it"], state["rank"]]
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_two_gloo_ranks_agree_on_the_iteration(tmp_path: Path) -> None:
    lines = run_gloo_ranks(TWO_RANKS, [str(tmp_path)], timeout=90)
    for rank, line in enumerate(lines):
        result = json.loads(line)
        assert result == {"a": [2, 2, 2, rank], "b": [1, 1, 1, rank], "c": [2, 1, 1, rank]}


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, where mounting is permitted (root, or CAP_SYS_ADMIN)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)]
    try:
        result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=WAIT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot run mount: {e}")
    if result.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        gc.collect()  # loaded tensors map files on it
        subprocess.run(["umount", "-l", str(mount_point)], check=True, timeout=WAIT_S)


def test_a_full_disk_keeps_the_previous_checkpoint(small_tmpfs: Path) -> None:
    manager = LocalCheckpointManager(small_tmpfs, keep_complete=1)
    manager.save({"w": torch.ones(1000)}, 1)
    big = {"w": torch.zeros(512 * 1024)}  # 2 MiB
    with pytest.raises(
        CheckpointWriteError, match=r"iter_0000002/rank0-of1\.ftckpt: No space left"
    ):
        manager.save(big, 2)
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        manager.save(big, 2, is_async=True)  # the space is reserved before save returns
    assert manager.find_latest() == 1
    state, _ = manager.load()
    assert state["w"].eq(1).all()
    del state
    manager.save({"w": torch.ones(10)}, 3)
    assert files(small_tmpfs) == ["iter_0000003", "iter_0000003/rank0-of1.ftckpt"]


def nvrx_groups(jump: int, factor: int, world_size: int) -> list[tuple[int, ...]]:
    """NVRx's `parse_group_sequence`, restated: ranks b, b+J, b+2J, ... cut into runs of F."""
    groups = []
    for first in range(jump):
        ranks = list(range(first, world_size, jump))
        groups += [tuple(ranks[i : i + factor]) for i in range(0, len(ranks), factor)]
    return sorted(groups)


def cliques(strategy: CliqueReplicationStrategy, world_size: int) -> list[tuple[int, ...]]:
    """Every clique of a job of `world_size` ranks, ordered by their first rank."""
    return sorted({strategy.clique_of(rank, world_size) for rank in range(world_size)})


def test_cliques_match_nvrx() -> None:
    strategy = CliqueReplicationStrategy.from_replication_params(8, 2)
    assert strategy.clique_of(17, 32) == (17, 25) and strategy.clique_of(25, 32) == (17, 25)
    assert cliques(strategy, 32)[:2] == [(0, 8), (1, 9)]
    for jump in range(1, 5):
        for factor in range(1, 5):
            for world_size in range(jump * factor, 49, jump * factor):
                strategy = LazyCliqueReplicationStrategy(jump, factor)
                assert cliques(strategy, world_size) == nvrx_groups(jump, factor, world_size)
                for rank in range(world_size):
                    assert rank in strategy.clique_of(rank, world_size)


@pytest.mark.parametrize(
    ("jump", "factor", "message"),
    [
        (0, 2, "replication_jump must be an int >= 1, not 0"),
        (1, 0, "replication_factor must be an int >= 1, not 0"),
        (True, 2, "replication_jump must be an int >= 1, not True"),
        (1, 2.0, "replication_factor must be an int >= 1, not 2.0"),
    ],
)
def test_replication_parameters_are_checked(jump: Any, factor: Any, message: str) -> None:
    with pytest.raises(CheckpointUsageError, match=message):
        CliqueReplicationStrategy.from_replication_params(jump, factor)


def test_clique_of_checks_rank_and_world_size() -> None:
    strategy = CliqueReplicationStrategy(replication_jump=2, replication_factor=2)
    with pytest.raises(CheckpointUsageError, match=r"world size must be a multiple of .* = 4"):
        strategy.clique_of(0, 6)
    with pytest.raises(CheckpointUsageError, match=r"rank 8 is not in 0\.\.7"):
        strategy.clique_of(8, 8)


def test_a_replication_strategy_is_kept_but_not_pretended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = LazyCliqueReplicationStrategy(replication_jump=1, replication_factor=2)
    with caplog.at_level(logging.INFO, logger="ftrun.checkpointing.manager"):
        manager = LocalCheckpointManager(tmp_path, repl_strategy=strategy)
    assert manager.repl_strategy is strategy
    assert "NOT replicated" in caplog.text and len(caplog.records) == 1


def test_node_memory_parts_reuse_the_retired_parts_memory(tmp_path: Path, monkeypatch) -> None:
    """Under ft_launcher a retired part becomes its rank's recycled file, and the next save
    writes into that same file (same inode, still mapped) instead of allocating a new one;
    parts read back intact, and a part this process loaded is never rewritten."""
    monkeypatch.setenv("FTRUN_CKPT_DIR", str(tmp_path / "node"))
    manager = LocalCheckpointManager(tmp_path / "disk", session_id="s", keep_complete=1)
    session = tmp_path / "node" / "s"
    inodes = []
    for iteration in range(1, 5):
        manager.save({"w": torch.full((1000,), float(iteration)), "i": iteration}, iteration)
        inodes.append((session / f"iter_{iteration:07d}" / "rank0-of1.ftckpt").stat().st_ino)
    recycled = session / ".recycled-rank0-of1.ftckpt.0"
    assert recycled.exists() and len(set(inodes)) == 2  # two files take turns
    state, ckpt = manager.load()
    assert ckpt.iteration == 4 and float(state["w"][0]) == 4.0 and state["i"] == 4
    manager.save({"w": torch.full((1000,), 5.0), "i": 5}, 5)  # retires 4: loaded, so deleted
    assert float(state["w"][0]) == 4.0  # the loaded view still reads what it loaded
    assert not (session / "iter_0000004").exists()
    assert manager.load()[0]["i"] == 5


def test_warmed_memory_is_what_the_next_saves_write_into(tmp_path: Path, monkeypatch) -> None:
    """`warm_up` makes the files the next saves rotate through (a previous process's recycled
    file first), mapped: those saves make no file of their own, and read back intact."""
    monkeypatch.setenv("FTRUN_CKPT_DIR", str(tmp_path / "node"))
    session = tmp_path / "node" / "s"
    session.mkdir(parents=True)
    left = session / ".recycled-rank0-of1.ftckpt"  # a previous process's (the old name)
    left.write_bytes(b"x" * 10)  # too small for the state: replaced
    manager = LocalCheckpointManager(tmp_path / "disk", session_id="s", keep_complete=2)
    state = {"w": torch.zeros(100_000)}
    manager.warm_up(state, 0, parts=3)
    assert manager.wait() is None
    warmed = {p.stat().st_ino for p in session.glob(".recycled-*")}
    assert len(warmed) == 3 and not left.exists()
    inodes = set()
    for iteration in range(1, 8):
        manager.save({"w": torch.full((100_000,), float(iteration))}, iteration, overlap=True)
        manager.fence()
        manager.wait()
        inodes.add((session / f"iter_{iteration:07d}" / "rank0-of1.ftckpt").stat().st_ino)
    assert inodes == warmed  # the three warmed files take turns, nothing else was made
    assert float(manager.load()[0]["w"][0]) == 7.0


@pytest.mark.parametrize("recycle", [False, True])
def test_a_part_is_written_though_another_rank_removed_its_directory_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recycle: bool
):
    """Ranks of a node share the iteration's directory, and the last rank out of an old
    iteration removes it: between one rank's mkdir and its first file there, another rank's
    retention may rmdir it (seen as a FileNotFoundError in a 2-rank StepSnapshot job). The
    write makes the directory again and goes on."""
    from ftrun.checkpointing import store as store_module

    real, removed = store_module.prepare_part, []

    def racing(path: Path, *args: Any, **kwargs: Any) -> Any:
        if not removed:  # the other rank's rmdir, just after our mkdir
            path.parent.rmdir()
            removed.append(path.parent)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store_module, "prepare_part", racing)
    store = DirectoryStore(tmp_path, recycle=recycle)
    key = PartKey(7, 1, 2)
    store.write(key, {"w": torch.arange(4.0)}, {})
    assert removed and torch.equal(store.read(key)[0]["w"], torch.arange(4.0))
