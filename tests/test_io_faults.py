"""Each I/O error at each write, in turn (issue 54), through the fault-injecting file layer
(tests/faultfs.py): for every file system call a clean save makes, the same save again with
that call failing (ENOSPC, EIO, EDQUOT, or a raw write cut short). Afterwards the newest
complete checkpoint loads bit-equal, nothing partial is read as complete, the error names the
path, and the next save succeeds."""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import json
import shutil
import time
from logging import WARNING
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from faultfs import HANG, SHORT, WRITES, FaultyFS
from ftrun.agent.loop.reporting import CycleReport
from ftrun.agent.workers import _pump
from ftrun.checkpointing import (
    AsyncCallTimeoutError,
    CheckpointError,
    CheckpointWriteError,
    GlobalCheckpointManager,
    LocalCheckpointManager,
    StepSnapshot,
)
from ftrun.checkpointing.persist import copy_part
from ftrun.eventlog.writer import EventLog
from ftrun.rank_monitor import HangKind, Verdict
from support import wait_for

ERRORS = (errno.ENOSPC, errno.EIO, errno.EDQUOT, SHORT)
# DCP warns that it saves in one process when torch.distributed is not initialized.
single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(autouse=True)
def single_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")


def state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((4096,), float(step)), "b": torch.arange(8) * step},
            "step": step}  # fmt: skip


def same(loaded: dict[str, Any], step: int) -> bool:
    want = state(step)
    return (
        loaded["step"] == step
        and torch.equal(loaded["model"]["w"], want["model"]["w"])
        and torch.equal(loaded["model"]["b"], want["model"]["b"])
    )


def local_calls(root: Path) -> list[tuple[str, str]]:
    manager = LocalCheckpointManager(root, session_id="s")
    manager.save(state(1), 1)
    with FaultyFS(root) as fs:
        manager.save(state(2), 2)
    return fs.calls


def test_each_write_of_the_local_tier_fails_in_turn(tmp_path: Path) -> None:
    calls = local_calls(tmp_path / "count")
    for index, error in cases(calls):
        root = tmp_path / f"{index}-{error}"
        manager = LocalCheckpointManager(root, session_id="s")
        manager.save(state(1), 1)
        with FaultyFS(root, fail_at=index, error=error) as fs:
            try:
                manager.save(state(2), 2)
                saved = True
            except CheckpointWriteError as e:
                saved = False
                assert fs.failed is not None and str(root) in str(e), (calls[index], e)
        where = f"call {index} {calls[index]} errno {error}"
        newest = manager.find_latest()
        # A failed save may still be whole (the directory's fsync after the rename failed).
        assert newest == 2 if saved else newest in (1, 2), where
        loaded, _ = manager.load()
        assert same(loaded, newest), where
        manager.save(state(3), 3)
        assert manager.find_latest() == 3, where
        assert same(manager.load()[0], 3), where


def cases(
    calls: list[tuple[str, str]], errors: tuple[int, ...] = ERRORS, last: bool = True
) -> list[tuple[int, int]]:
    """Each of `errors` at the first (and, with `last`, the last) of each kind of call on each
    path: DCP writes a file in many small writes, and the ones between fail the same way."""
    assert len(calls) >= 3, calls
    ends: dict[tuple[str, str], list[int]] = {}
    for index, call in enumerate(calls):
        ends.setdefault(call, []).append(index)
    picked = sorted({found[0] for found in ends.values()})
    if last:
        picked = sorted({*picked, *(found[-1] for found in ends.values())})
    # Only a raw write can be short; elsewhere SHORT would be a clean save again.
    return [
        (i, e) for i, e in itertools.product(picked, errors) if e != SHORT or calls[i][0] in WRITES
    ]


def test_each_write_of_a_step_snapshot_fails_in_turn(tmp_path: Path) -> None:
    """In the background: the error is raised by the next `wait()`, once; the next snapshot
    is taken and restores."""

    def snapshot_calls(root: Path) -> list[tuple[str, str]]:
        snapshot = StepSnapshot(root)
        snapshot.save(state(1), 1)
        snapshot.wait()
        with FaultyFS(root) as fs:
            snapshot.save(state(2), 2)
            snapshot.wait()
        snapshot.close()
        return fs.calls

    calls = snapshot_calls(tmp_path / "count")
    for index, error in cases(calls):
        root = tmp_path / f"{index}-{error}"
        snapshot = StepSnapshot(root)
        snapshot.save(state(1), 1)
        snapshot.wait()
        with FaultyFS(root, fail_at=index, error=error) as fs:
            snapshot.save(state(2), 2)
            with contextlib.suppress(CheckpointWriteError):
                snapshot.wait()
        where = f"call {index} {calls[index]} errno {error}"
        assert fs.failed is not None or error == SHORT, where
        into = state(0)
        assert StepSnapshot(root).restore(into) in (1, 2), where
        assert same(into, into["step"]), where
        snapshot.save(state(3), 3)
        snapshot.wait()
        snapshot.close()
        into = state(0)
        assert StepSnapshot(root).restore(into) == 3 and same(into, 3), where


def test_full_node_memory_at_start_does_not_stop_the_script(tmp_path, monkeypatch, caplog):
    """Under ft_launcher the file that tells the agent how to keep the parts cannot be written
    (node memory full): the manager starts anyway, says so, leaves no half-written file, and
    writes it once a part was saved (seen in a job: every rank died in its constructor)."""
    monkeypatch.setenv("FTRUN_CKPT_DIR", str(tmp_path / "node"))
    (tmp_path / "node" / "s").mkdir(parents=True)
    policy = tmp_path / "node" / "s" / ".policy.json"
    for index in (1, 2):  # the temp file's creation, then its rename (0: an existing mkdir)
        faulty = FaultyFS(tmp_path / "node", fail_at=index, error=errno.ENOSPC)
        with faulty as fs, caplog.at_level(WARNING, logger="ftrun.checkpointing"):
            manager = LocalCheckpointManager(tmp_path / "disk", session_id="s")
        assert fs.failed is not None and "not replicated yet" in caplog.text, fs.calls
        assert not policy.exists() and not list(policy.parent.glob(".policy.json*")), index
        manager.save(state(1), 1)
        assert policy.exists() and same(manager.load()[0], 1)
        policy.unlink()


def test_a_failed_step_snapshot_is_said_and_the_training_goes_on(tmp_path, caplog) -> None:
    """A save whose background write fails (node memory full) does not stop the script: the
    next `save()` logs it, counts it, and is taken; the newest complete snapshot stays."""
    snapshot = StepSnapshot(tmp_path)
    assert snapshot.save(state(1), 1)
    snapshot.wait()
    with FaultyFS(tmp_path, fail_at=0, error=errno.ENOSPC):
        assert snapshot.save(state(2), 2)
        wait_for(lambda: not snapshot._manager.saving, 30, "the failing background write")
    into = state(0)
    assert StepSnapshot(tmp_path).restore(into) == 1 and same(into, 1)
    with caplog.at_level(WARNING, logger="ftrun.checkpointing.snapshot"):
        assert snapshot.save(state(3), 3)
    assert snapshot.failed == 1 and "a step snapshot failed" in caplog.text
    snapshot.close()
    into = state(0)
    assert StepSnapshot(tmp_path).restore(into) == 3 and same(into, 3)


@single_process
def test_each_write_of_the_global_tier_fails_in_turn(tmp_path: Path) -> None:
    """ENOSPC or EIO, in turn, at the first call of each kind on each path (the same code path
    takes every errno; the local tier's tests try all four); each case starts from a
    copy of one saved checkpoint."""
    base = tmp_path / "base"
    manager = GlobalCheckpointManager(base)
    manager.save(state(1), 1, is_async=False)
    manager.close()
    shutil.copytree(base, tmp_path / "count")
    manager = GlobalCheckpointManager(tmp_path / "count")
    with FaultyFS(tmp_path / "count") as fs:
        manager.save(state(2), 2, is_async=False)
    manager.close()
    picked = cases(fs.calls, (errno.ENOSPC,), last=False)
    for turn, (index, _) in enumerate(picked):
        error = (errno.ENOSPC, errno.EIO)[turn % 2]
        root = shutil.copytree(base, tmp_path / f"{index}-{error}")
        manager = GlobalCheckpointManager(root)
        where = f"call {index} {fs.calls[index]} errno {error}"
        with FaultyFS(root, fail_at=index, error=error) as injected:
            try:
                manager.save(state(2), 2, is_async=False)
            except CheckpointError as e:  # AsyncCallError, the CheckpointWriteError its cause
                assert str(root) in str(e) and "\n" not in str(e), (where, e)
        assert injected.failed is not None, where
        into = state(0)
        assert manager.load(into) in (1, 2), where
        assert same(into, into["step"]), where
        manager.close()


@pytest.mark.parametrize("error", ERRORS)
def test_the_events_log_goes_on_past_a_failing_disk(
    tmp_path: Path, error: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Each of 6 writes fails in turn: the job's events stop being written, not the agent; one
    warning when it starts, one when it ends; every event written is a whole line."""
    for index in range(6):
        root = tmp_path / f"{index}"
        root.mkdir()
        caplog.clear()
        # Call 0 is the open (a --log-dir that cannot be written is refused at start-up).
        with FaultyFS(root, index + 1, error), caplog.at_level(WARNING, "ftrun.agent"):
            events = EventLog(root, "n0")
            for number in range(6):
                events.emit("signal", signal=f"S{number}")
        events.close()
        lines = (root / "events-n0.jsonl").read_text().splitlines()
        read = [json.loads(line)["signal"] for line in lines if line.startswith("{")]
        lost = {f"S{index}"} if error != SHORT else set()
        assert set(read) | lost == {f"S{n}" for n in range(6)}, (index, lines)
        warned = [r.getMessage() for r in caplog.records if "events" in r.getMessage()]
        assert len(warned) == (0 if error == SHORT else 1 + (index < 5)), warned


def test_a_worker_log_on_a_failing_disk_is_given_up_and_the_stream_still_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The open, then each write of a worker's stdout log fails in turn: one warning, every
    line still reaches the console (the worker never blocks on a full pipe)."""
    lines = [f"line {n}\n".encode() for n in range(5)]
    for index in range(len(lines) + 1):
        root = tmp_path / f"{index}"
        root.mkdir()
        console = SimpleNamespace(buffer=io.BytesIO())
        caplog.clear()
        with FaultyFS(root, index, errno.ENOSPC), caplog.at_level(WARNING, "ftrun.agent"):
            _pump(io.BytesIO(b"".join(lines)), root / "stdout.log", console, True, b"[0] ")
        assert console.buffer.getvalue() == b"".join(b"[0] " + line for line in lines)
        kept = (root / "stdout.log").read_bytes() if index else b""
        assert kept == b"".join(lines[: max(index - 1, 0)]), index
        assert len([r for r in caplog.records if "no longer written" in r.getMessage()]) == 1


def test_a_hang_is_reported_when_its_stacks_cannot_be_kept(tmp_path: Path) -> None:
    """A full log disk at a hang verdict: the stacks are not kept (a warning), the hang is still
    logged and an event, and the agent goes on (it raised out of the report before)."""
    events = EventLog(tmp_path, "n0")
    runtime = SimpleNamespace(events=events, node="n0", node_log_dir=tmp_path / "n0")
    verdict = Verdict(rank=1, pid=7, worker_pid=7, kind=HangKind.HEARTBEAT, section=None,
                      timeout=3.0, waited=3.1, deadline=10.0, detected_at=10.1,
                      stack_file=None, stack="stacks")  # fmt: skip
    with FaultyFS(tmp_path / "n0", fail_at=0, error=errno.ENOSPC) as fs:
        CycleReport(runtime).hang(verdict, None)  # type: ignore[arg-type]
    events.close()
    assert fs.failed is not None
    (hang,) = [json.loads(line) for line in (tmp_path / "events-n0.jsonl").read_text().splitlines()]
    assert hang["event"] == "hang" and hang["rank"] == 1 and hang.get("stack_file") is None


def test_each_write_of_a_copy_to_disk_fails_in_turn(tmp_path: Path) -> None:
    """The node tier's copy of a part to disk (`persist.copy_part`): a failed copy leaves no
    file under the part's name and no temporary, and says which path."""
    source = tmp_path / "part"
    source.write_bytes(bytes(range(256)) * 64)

    def copy(root: Path) -> None:
        copy_part(source, root / "iter_0000002" / "rank0-of1.ftckpt")

    with FaultyFS(tmp_path / "count") as fs:
        copy(tmp_path / "count")
    for index, error in cases(fs.calls):
        root = tmp_path / f"{index}-{error}"
        with FaultyFS(root, fail_at=index, error=error) as injected:
            try:
                copy(root)
            except CheckpointWriteError as e:
                assert injected.failed is not None and str(root) in str(e), e
        where = f"call {index} {fs.calls[index]} errno {error}"
        names = sorted(p.name for p in root.rglob("*") if p.is_file())
        assert names in ([], ["rank0-of1.ftckpt"]), (where, names)
        if names:
            assert (root / "iter_0000002" / "rank0-of1.ftckpt").read_bytes() == source.read_bytes()


@single_process
def test_a_save_hung_in_the_global_directory_is_abandoned_at_its_bound(tmp_path: Path) -> None:
    """A write that never returns (a hung shared file system): the finalize gives up at the
    manager's timeout, the save is abandoned, the next one is written and published beside
    the hung thread, and the previous checkpoint stays loadable."""
    manager = GlobalCheckpointManager(tmp_path, timeout_s=0.5)
    manager.save(state(1), 1, is_async=False)
    with FaultyFS(tmp_path, fail_at=3, error=HANG) as fs:
        manager.save(state(2), 2)
        started = time.monotonic()
        with pytest.raises(AsyncCallTimeoutError, match="abandoned"):
            manager.maybe_finalize(blocking=True)
        assert time.monotonic() - started < 5 and fs.failed is not None
        manager.save(state(3), 3)
        assert manager.maybe_finalize(blocking=True) == [3]
    into = state(0)
    assert manager.load(into) == 3 and same(into, 3)
    manager.close()
