"""Local checkpoints in node memory under ft_launcher: kept by the agent across restarts,
replicated to peers, restored before the workers start (issue 15), with real launchers."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import psutil
import pytest

from ftrun.checkpointing.keeper.node_tier import DEFAULT_BASES, DIR_PREFIX
from launch import Job, Node, node_of, start_job
from support import wait_for

pytestmark = pytest.mark.process

WORKER = Path(__file__).resolve().parent / "workers" / "ckpt_worker.py"
ARGS = ["--max-restarts=3", "--rdzv-conf=last_call_timeout=5"]


def resumed(job: Job, rank: int) -> dict[int, int]:
    """cycle -> the iteration that rank resumed from in it (-1: from scratch)."""
    path = job.ckpt_dir / f"rank{rank}.log"
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return {int(cycle): int(loaded) for cycle, _step, loaded in rows}


def test_global_saves_under_two_launchers_and_a_crash_resumes_from_the_newest_tier(
    tmp_path: Path,
):
    """Async global saves (DCP) beside the local ones, 2 nodes x 2 ranks: after a crash at 17,
    node memory's 15 beats the global 10; at the end the two newest global saves are visible,
    complete, and nothing half-written is."""
    worker_args = ["--crash", "0:1:17", "--global-every", "2", "--steps", "40"]
    job = start_job(tmp_path, 2, ARGS, worker_args, script=WORKER, nproc=2)
    assert job.wait(150) == [0, 0]
    for rank in range(4):
        rows = [
            line.split() for line in (job.ckpt_dir / f"rank{rank}.log").read_text().splitlines()
        ]
        resumes = {int(cycle): (int(loaded), tier) for cycle, _step, loaded, tier in rows}
        assert resumes == {0: (-1, "none"), 1: (15, "local")}, (rank, resumes)
    published = sorted(p.name for p in (job.ckpt_dir / "global").iterdir())
    assert published == ["iter_0000030", "iter_0000040"], published
    assert (job.ckpt_dir / "global" / "iter_0000040" / "MANIFEST.json").is_file()


def test_a_worker_killed_in_the_middle_of_a_save_resumes_from_node_memory_at_the_previous_one(
    tmp_path: Path,
):
    """Rank 1 dies (SIGKILL) in its save of 10: both ranks resume from node memory at 5, and
    every save was also copied where NVRx writes (persist_to_disk). (A crash that resumes from
    node memory's newest save, 2 ranks a node and the global tier beside it: the test above.)"""
    job = start_job(tmp_path, 2, ARGS, ["--die-in-save", "0:1:10"], script=WORKER)
    assert job.wait(120) == [0, 0]
    assert resumed(job, 0) == {0: -1, 1: 5} and resumed(job, 1) == {0: -1, 1: 5}
    restores = [e for e in job.events("ckpt_restore") if e["cycle"] == 1]
    assert {e["iteration"] for e in restores} == {5}
    assert (job.ckpt_dir / "FINISHED").exists()
    newest = max((job.ckpt_dir / "local").glob("iter_*"))
    assert sorted(p.name for p in newest.iterdir()) == ["rank0-of2.ftckpt", "rank1-of2.ftckpt"]


def test_a_flipped_byte_is_detected_and_a_peers_replica_is_used(tmp_path: Path):
    """Rank 0 is frozen, every part of it on its own node gets a flipped byte, then it dies:
    the restart agrees on the newest iteration, rank 0 finds its part corrupt and fails, and
    at the next restart its node fetches rank 0's replica from the other node."""
    job = start_job(
        # 60 steps: rank 0 is frozen about 10 steps in; the rest only has to outlast that.
        tmp_path, 2, ARGS, ["--steps", "60", "--step-time", "0.1"], script=WORKER
    )  # fmt: skip
    wait_for(lambda: len(job.events("ckpt_replicated")) >= 4, 90, "replicated checkpoints")
    rank0 = next(e for e in job.events("workers_started") if e["ranks"] == [0])
    worker = psutil.Process(rank0["pids"][0])
    worker.suspend()  # no save of rank 0 completes from now on (nor of rank 1: it waits)
    node = node_of(job, rank0["node"])
    parts = [p for p in keeper_dir(node).rglob("rank0-of2.ftckpt") if "iter_" in str(p)]
    assert parts
    for part in parts:
        flip_last_byte(part)
    newest = max(int(p.parent.name.removeprefix("iter_")) for p in parts)
    worker.kill()
    assert job.wait(180) == [0, 0]
    corrupt = job.events("ckpt_corrupt")
    assert corrupt and {e["rank"] for e in corrupt} == {0}
    again = [e for e in job.events("ckpt_restore") if e["cycle"] == corrupt[0]["cycle"]]
    assert {e["iteration"] for e in again} == {newest} and any(e["fetched"] for e in again)
    assert resumed(job, 0)[corrupt[0]["cycle"]] == newest


def keeper_dir(node: Node) -> Path:
    """The launcher's FTRUN_CKPT_DIR: named after the run id and the agent's pid (`NodeTier`).
    (A forked worker's /proc/PID/environ is its fork server's, not the worker's.)"""
    bases = (*DEFAULT_BASES, Path(tempfile.gettempdir()))
    found = [d for base in bases for d in base.glob(f"{DIR_PREFIX}*-{node.proc.pid}-*")]
    assert len(found) == 1, f"launcher {node.index}: node checkpoint dirs {found}"
    return found[0]


def flip_last_byte(path: Path) -> None:
    with path.open("r+b") as part:
        part.seek(-1, os.SEEK_END)
        byte = part.read(1)
        part.seek(-1, os.SEEK_END)
        part.write(bytes([byte[0] ^ 0xFF]))
