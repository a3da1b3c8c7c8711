"""Global checkpoints through DCP and `restore` across tiers: the pure decisions (which tier,
what to keep, which files a rank checks), the manifest and the metadata allowlist in process;
then real gloo ranks: 4 ranks save a DTensor-sharded state asynchronously and publish it
together, a failing writer is an error on every rank within the bound, a flipped byte sends
`restore` to the previous iteration, and a crash in the middle of a save leaves nothing visible.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from ftrun.checkpointing import (
    CheckpointNotFoundError,
    GlobalCheckpointManager,
    LocalCheckpointManager,
    restore,
)
from ftrun.checkpointing import global_files as gf
from ftrun.checkpointing.dcp_safe import load_metadata
from ftrun.checkpointing.hierarchy import Verdict, choose, judge
from support import run_gloo_ranks

# One process without torch.distributed: DCP says it assumes a single process.
single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_threads")]


@pytest.mark.parametrize(
    ("newest", "dropped", "expected"),
    [
        ([5, 3], set(), 0),  # local newer
        ([3, 5], set(), 1),  # global newer
        ([4, 4], set(), 0),  # a tie: the faster tier
        ([-1, -1], set(), None),
        ([5, 3], {0}, 1),
        ([7, 9, 9], set(), 1),
    ],
)
def test_choose(newest: list[int], dropped: set[int], expected: int | None) -> None:
    assert choose(newest, frozenset(dropped)) == expected


@pytest.mark.parametrize(
    ("newest", "tier", "low", "high", "verdict"),
    [
        ([5, 3], 0, 5, 5, Verdict.ACCEPT),
        ([5, 3], 0, -1, 5, Verdict.REQUERY),  # failed on one rank
        ([5, 3], 0, -1, -1, Verdict.REQUERY),
        ([5, 3], 0, 4, 5, Verdict.REQUERY),  # ranks loaded different iterations
        ([5, 3], 0, 4, 4, Verdict.ACCEPT),  # fell back, still the newest
        ([5, 4], 0, 3, 3, Verdict.RECHOOSE),  # fell back below the global one
        ([5, 3], 0, 3, 3, Verdict.ACCEPT),  # a tie with a slower tier: keep it
    ],
)
def test_judge(newest: list[int], tier: int, low: int, high: int, verdict: Verdict) -> None:
    assert judge(newest, tier, low, high) is verdict


def test_retention_keeps_the_newest_and_drops_a_rolled_back_future() -> None:
    assert gf.retention([1, 2, 3, 4], saved=4, keep_last=2) == [1, 2]
    assert gf.retention([1, 2, 3, 9], saved=3, keep_last=2) == [1, 9]
    assert gf.retention([3], saved=3, keep_last=1) == []


def test_each_file_is_checked_by_the_rank_that_wrote_it() -> None:
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__3_0.distcp", "MANIFEST.json",
             ".crc-rank1.json"]  # fmt: skip
    assert gf.files_of_rank(names, 0, 2) == [".metadata", "__0_0.distcp", "__3_0.distcp"]
    assert gf.files_of_rank(names, 1, 2) == ["__1_0.distcp"]
    assert gf.files_of_rank(names, 0, 1) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                             "__3_0.distcp"]  # fmt: skip


def test_manifest_round_trip_and_damage() -> None:
    files = {".metadata": gf.FileEntry(10, 0xDEADBEEF), "__0_0.distcp": gf.FileEntry(5, 1)}
    raw = gf.encode_manifest(gf.Manifest(7, 2, files))
    decoded = gf.decode_manifest(raw)
    assert (decoded.iteration, decoded.world_size, dict(decoded.files)) == (7, 2, files)
    with pytest.raises(ValueError, match="checksum"):
        gf.decode_manifest(raw.replace(b'"iteration":7', b'"iteration":8'))
    with pytest.raises(ValueError, match="not JSON"):
        gf.decode_manifest(raw[:-5])


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


def test_metadata_unpickler_refuses_anything_but_dcp_metadata() -> None:
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system is not allowed"):
        load_metadata(io.BytesIO(pickle.dumps(_Evil())))
    with pytest.raises(pickle.UnpicklingError, match="is a dict"):
        load_metadata(io.BytesIO(pickle.dumps({"a": 1})))


def _state(value: float, step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 8), value), "b": torch.arange(4, dtype=torch.bfloat16)},
        "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]},
        "step": step,
    }


@single_process
def test_one_process_saves_publishes_and_falls_back_past_a_flipped_byte(tmp_path: Path) -> None:
    manager = GlobalCheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        manager.save(_state(step, step), step)
        assert not (tmp_path / gf.iter_dir_name(step)).exists()  # not before the finalize
    assert manager.maybe_finalize(blocking=True) == [3]
    manager.save(_state(4, 4), 4, is_async=False)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004"]
    target = _state(0, 0)
    assert manager.load(target) == 4
    assert torch.equal(target["model"]["w"], torch.full((64, 8), 4.0)) and target["step"] == 4
    assert target["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    _flip_byte(tmp_path / "iter_0000004" / "__0_0.distcp")
    assert manager.load(target) == 3 and target["step"] == 3
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004.corrupt"]
    manager.close()


@single_process
def test_restore_prefers_the_newest_tier_and_falls_back_across_tiers(tmp_path: Path) -> None:
    local = LocalCheckpointManager(tmp_path / "local", keep_complete=2)
    glob = GlobalCheckpointManager(tmp_path / "global")
    glob.save(_state(1, 10), 10, is_async=False)
    local.save(_state(2, 20), 20)
    restored = restore([local, glob], _state(0, 0))
    assert (restored.iteration, restored.tier, restored.state["step"]) == (20, "local", 20)
    _flip_byte(tmp_path / "local" / "iter_0000020" / "rank0-of1.ftckpt")
    restored = restore([local, glob], _state(0, 0))
    assert (restored.iteration, restored.tier, restored.state["step"]) == (10, "global", 10)
    _flip_byte(tmp_path / "global" / "iter_0000010" / ".metadata")
    with pytest.raises(CheckpointNotFoundError, match="no loadable checkpoint"):
        restore([local, glob], _state(0, 0))
    glob.close()


def _flip_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    path.write_bytes(bytes(blob))


# What the ranks' parent imports before forking them (DCP and DTensor: about 0.7 CPU-s a rank).
DCP = ("torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor")
PRELUDE = r"""
import datetime, json, os, sys, threading, time
import torch, torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from ftrun.checkpointing import (AsyncCallError, GlobalCheckpointManager,
    LocalCheckpointManager, restore)

root, rank = sys.argv[1], int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
world = dist.get_world_size()
fault = {"fail_rank": None, "hold": None}
held = threading.Event()  # set once a held write is under way
write_data = FileSystemWriter.write_data
def faulty_write_data(self, plan, planner):  # the injected faults: fail, or hold the write
    if fault["fail_rank"] == rank:
        raise OSError("No space left on device")
    while fault["hold"] is not None and not os.path.exists(fault["hold"]):
        held.set()
        time.sleep(0.01)
    return write_data(self, plan, planner)
FileSystemWriter.write_data = faulty_write_data
def visible():
    return sorted(n for n in os.listdir(os.path.join(root, "global")) if not n.startswith("."))
out = {}
"""

FOUR_RANKS = (
    PRELUDE
    + r"""
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
mesh = init_device_mesh("cpu", (world,))
def state(step):
    # DCP treats a plain tensor under the same key on every rank as replicated (saved once):
    # each rank's own one has a key of its own; the DTensor is sharded over the 4 ranks.
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + step
    mine = torch.full((4,), rank + step)
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), f"mine{rank}": mine, "step": step}
def check(target, step):
    expected = state(step)
    key = f"mine{rank}"
    return (torch.equal(target["w"].to_local(), expected["w"].to_local())
            and torch.equal(target[key], expected[key]) and target["step"] == step)

glob = GlobalCheckpointManager(os.path.join(root, "global"), keep_last=2, timeout_s=20)
local = LocalCheckpointManager(os.path.join(root, "local"))
local_state = state(1)  # the local tier keeps each rank's own shard
local.save({**local_state, "w": local_state["w"].to_local()}, 1)
published = []
for step in (1, 2, 3):
    glob.save(state(step), step)
    while not (done := glob.maybe_finalize()):
        time.sleep(0.1)  # each poll is a collective while a save is pending
    published += done
dist.barrier()  # rank 0's finalize publishes: after it returns there
out["published"], out["visible"] = published, visible()

fault["fail_rank"] = 1
glob.save(state(4), 4)
start = time.monotonic()
try:
    glob.maybe_finalize(blocking=True)
except AsyncCallError as e:
    out["failure"] = [str(e), time.monotonic() - start < 10]
fault["fail_rank"] = None
dist.barrier()
out["after_failure"] = visible()

if rank == 0:  # a flipped byte in a file rank 1 wrote (and rank 1 checks)
    path = os.path.join(root, "global", "iter_0000003", "__1_0.distcp")
    blob = bytearray(open(path, "rb").read()); blob[len(blob) // 2] ^= 1
    open(path, "wb").write(blob)
dist.barrier()
target = state(0)
restored = restore([local, glob], target)
out["restored"] = [restored.iteration, restored.tier, check(restored.state, 2)]
dist.barrier()
out["after_restore"] = visible()
glob.close()
dist.destroy_process_group()
print(json.dumps(out))
"""
)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_four_ranks_save_publish_fail_and_restore_past_a_flipped_byte(tmp_path: Path) -> None:
    lines = run_gloo_ranks(FOUR_RANKS, [str(tmp_path)], timeout=90, ranks=4, preload=DCP)
    for line in lines:
        result = json.loads(line)
        assert result["published"] == [1, 2, 3]
        assert result["visible"] == ["iter_0000002", "iter_0000003"]  # keep_last=2
        message, in_time = result["failure"]
        assert message.startswith("async call 3 failed") and in_time, message
        assert result["after_failure"] == ["iter_0000002", "iter_0000003"]
        assert result["restored"] == [2, "global", True]  # 3 is bad, local has only 1
        assert result["after_restore"] == ["iter_0000002", "iter_0000003.corrupt"]
    manifest = json.loads((tmp_path / "global" / "iter_0000002" / gf.MANIFEST).read_bytes())
    assert sorted(manifest["files"]) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]


CRASH = (
    PRELUDE
    + r"""
glob = GlobalCheckpointManager(os.path.join(root, "global"), timeout_s=20)
state = {f"w{rank}": torch.full((16,), float(rank)), "step": 1}  # a key per rank: sharded
glob.save(state, 1, is_async=False)
fault["hold"] = os.path.join(root, "never")
state["step"] = 2
glob.save(state, 2)
assert held.wait(20), "the write of 2 never started"  # under way, and held
glob.close(abort=True)
out["after_abort"] = visible()
print(json.dumps(out), flush=True)
os._exit(0)  # die as a killed process does: no finalizers, the writer threads gone
"""
)

RESTART = (
    PRELUDE
    + r"""
glob = GlobalCheckpointManager(os.path.join(root, "global"), timeout_s=20)
target = {f"w{rank}": torch.zeros(16), "step": 0}
restored = restore([glob], target)
out["restored"] = [restored.iteration, target["step"], torch.equal(target[f"w{rank}"],
                   torch.full((16,), float(rank)))]
out["hidden"] = sorted(n for n in os.listdir(os.path.join(root, "global")) if n.startswith("."))
glob.save({**target, "step": 2}, 2, is_async=False)
dist.barrier()  # rank 0's finalize publishes
out["after_save"] = sorted(os.listdir(os.path.join(root, "global")))
glob.close()
dist.destroy_process_group()
print(json.dumps(out))
"""
)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_crash_during_a_save_leaves_nothing_visible(tmp_path: Path) -> None:
    for line in run_gloo_ranks(CRASH, [str(tmp_path)], timeout=60, preload=DCP):
        assert json.loads(line)["after_abort"] == ["iter_0000001"]
    for rank, line in enumerate(run_gloo_ranks(RESTART, [str(tmp_path)], 60, preload=DCP)):
        result = json.loads(line)
        assert result["restored"] == [1, 1, True], rank
        assert len(result["hidden"]) == 1 and gf.is_tmp_dir_name(result["hidden"][0])
        assert result["after_save"] == ["iter_0000001", "iter_0000002"]  # abandoned one gone
