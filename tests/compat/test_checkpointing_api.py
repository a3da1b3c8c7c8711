"""NVRx 0.7's documented local-checkpointing names, written from its docs and signatures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftrun.checkpointing import (
    AsyncCallsQueue,
    AsyncRequest,
    BasicTensorAwareStateDict,
    CheckpointUsageError,
    CkptID,
    LocalCheckpointManager,
    TensorAwareStateDict,
    TorchAsyncCheckpoint,
)


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


@pytest.mark.parametrize("is_async", [False, True])
def test_under_ft_launcher_a_save_is_on_disk_where_nvrx_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, is_async: bool
) -> None:
    """The agent keeps parts in node memory (`FTRUN_CKPT_DIR`); NVRx users find their files
    under `root_local_ckpt_dir` once the save returned or its request finished."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    memory.mkdir(mode=0o700)
    monkeypatch.setenv("FTRUN_CKPT_DIR", str(memory))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    manager = LocalCheckpointManager(disk, session_id="s", keep_complete=1)
    state = {"w": torch.arange(6.0)}
    for iteration in (1, 2):
        request = manager.save(state, iteration, is_async=is_async)
        if request is not None:
            request.execute_sync()
        part = disk / "s" / f"iter_{iteration:07d}" / "rank0-of1.ftckpt"
        assert part.read_bytes() == (memory / "s" / part.parent.name / part.name).read_bytes()
    assert [p.name for p in (disk / "s").iterdir()] == ["iter_0000002"]  # retention there too
    loaded, _ = manager.load()  # from node memory
    assert torch.equal(loaded["w"], state["w"])


def test_under_ft_launcher_persist_to_disk_false_keeps_parts_in_memory_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    memory.mkdir(mode=0o700)
    monkeypatch.setenv("FTRUN_CKPT_DIR", str(memory))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    LocalCheckpointManager(disk, session_id="s", persist_to_disk=False).save(
        {"w": torch.ones(2)}, 1
    )
    assert (memory / "s" / "iter_0000001" / "rank0-of1.ftckpt").is_file() and not disk.exists()


def test_torch_async_checkpoint_saves_a_copy_taken_at_the_call(tmp_path: Path) -> None:
    """NVRx's async_ckpt.py: `async_save(state_dict, path)`, then
    `finalize_async_save(blocking=True, no_dist=True, terminate=True)`, then `torch.load`."""
    model = torch.nn.Linear(3, 2)
    state = model.state_dict()
    expected = {k: v.clone() for k, v in state.items()}
    checkpoint = TorchAsyncCheckpoint(persistent_queue=True)
    checkpoint.async_save(state, tmp_path / "ckpt.pt")
    with torch.no_grad():
        model.weight.add_(1.0)  # the caller goes on training: the save holds the old values
    checkpoint.finalize_async_save(blocking=True, no_dist=True, terminate=True)
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert getattr(loaded, "_metadata", None) == getattr(state, "_metadata", None)
    checkpoint.close()  # closing twice is harmless, as NVRx's example does
    with pytest.raises(RuntimeError, match="closed"):
        checkpoint.async_save(state, tmp_path / "again.pt")


def test_torch_async_checkpoint_without_a_persistent_queue(tmp_path: Path) -> None:
    checkpoint = TorchAsyncCheckpoint(persistent_queue=False)
    checkpoint.async_save({"x": [torch.ones(2), (torch.zeros(1), 3)]}, tmp_path / "c.pt")
    checkpoint.finalize_async_save(blocking=True)
    checkpoint.close()
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(loaded["x"][0], torch.ones(2)) and loaded["x"][1][1] == 3


def test_basic_tensor_aware_state_dict_has_nvrx_s_methods() -> None:
    state = BasicTensorAwareStateDict({"a": torch.ones(2), "b": [torch.zeros(3, 2), 7]})
    assert isinstance(state, TensorAwareStateDict) and not state.is_hollow
    popped = state.pop_tensors()
    assert [t.shape for t in popped] == [(2,), (3, 2)] and state.is_hollow
    with pytest.raises(RuntimeError, match="hollow"):
        state.pop_tensors()
    state.init_tensors()
    assert [t.shape for t in state.tensors] == [(2,), (3, 2)] and not state.is_hollow
    state.pop_tensors()
    state.insert_tensors(popped)
    assert state.tensors[0] is popped[0] and state.state_dict["b"][1] == 7
    state.copy_tensors_to_cpu()
    state.restore_tensor_device()
    assert torch.equal(state.state_dict["a"], torch.ones(2))


def test_another_tensor_aware_state_dict_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Custom(BasicTensorAwareStateDict):
        pass

    class Other(TensorAwareStateDict):  # every abstract method, as a user's subclass would
        pop_tensors = insert_tensors = init_tensors = lambda self, *a: None
        copy_tensors_to_cpu = restore_tensor_device = lambda self, *a: None
        tensors = is_hollow = property(lambda self: None)

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    manager = LocalCheckpointManager(tmp_path)
    manager.save(Custom({"w": torch.ones(1)}), 1)  # a Basic one is stored as such
    with pytest.raises(CheckpointUsageError, match="would need pickle"):
        manager.save(Other(), 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: no group
def test_two_phase_async_dcp_save_as_nvrx_s_async_writer(tmp_path: Path) -> None:
    """NVRx's async_writer.py pattern: plan (stages a copy), write in the queue's thread,
    finalize (metadata); torch's own FileSystemReader then loads what was saved."""
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, load

    from ftrun.checkpointing import (
        FileSystemWriterAsync,
        init_checkpoint_metadata_cache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    init_checkpoint_metadata_cache()
    model = torch.nn.Linear(4, 3)
    state = {"model": model.state_dict(), "step": 7}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    writer = FileSystemWriterAsync(tmp_path / "iter_1", thread_count=2)
    plan = save_state_dict_async_plan(state, writer, None, 0, planner=DefaultSavePlanner(),
                                      enable_cache=True)  # fmt: skip
    with torch.no_grad():
        model.weight.add_(1.0)  # after the plan returns, the save holds the old values
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    queue = AsyncCallsQueue()
    request = AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*plan)],
                           async_fn_kwargs={}, preload_fn=preload_fn)  # fmt: skip
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    queue.close()
    target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    load(target, storage_reader=FileSystemReader(tmp_path / "iter_1"))
    assert all(torch.equal(target["model"][k], expected[k]) for k in expected)
    assert target["step"] == 7
    with pytest.raises(CheckpointUsageError, match="multi-storage client"):
        FileSystemWriterAsync(tmp_path / "x", use_msc=True)


def test_nvrx_s_smaller_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    manager = LocalCheckpointManager(tmp_path, session_id="s")
    assert (manager.local_ckpt_dir, manager.rank) == (tmp_path / "s", 3)
    AsyncCallsQueue.warmup_persistent_caller(0)  # nothing to warm: a thread
    assert caplog.text == ""
    AsyncCallsQueue.warmup_persistent_caller(0, cpu_priority=19)
    assert "cpu_priority not applied" in caplog.text
