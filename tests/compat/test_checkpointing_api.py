"""NVRx 0.7's documented local-checkpointing names, written from its docs and signatures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftrun.checkpointing import AsyncCallsQueue, AsyncRequest, CkptID, LocalCheckpointManager


def test_ckpt_id_is_nvrx_s_tuple() -> None:
    ckpt_id = CkptID(1, 0, "")
    assert ckpt_id == (1, 0, "") and hash(ckpt_id) == hash((1, 0, ""))
    iteration, rank, session = ckpt_id
    assert (iteration, rank, session, ckpt_id[0], ckpt_id.session_id) == (1, 0, "", 1, "")


def test_async_save_returns_a_request_for_nvrx_s_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVRx's local_ckpt.py: `queue.schedule_async_request(manager.save(..., is_async=True))`,
    then `maybe_finalize_async_calls(blocking=True)`; the checkpoint is then there to load."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    manager = LocalCheckpointManager(tmp_path, session_id="s")
    queue = AsyncCallsQueue()
    state = {"w": torch.arange(6.0)}
    request = manager.save(state, 3, is_async=True)
    assert isinstance(request, AsyncRequest)
    queue.schedule_async_request(request)
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    loaded, ckpt_id = manager.load()
    assert ckpt_id == (3, 0, "s") and torch.equal(loaded["w"], state["w"])
    assert manager.save(state, 4) is None  # synchronous: nothing to schedule
    assert manager.wait() is None  # the queue joined the async write; nothing left to wait for
    queue.close()
