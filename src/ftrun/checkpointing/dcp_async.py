"""NVRx's two-phase asynchronous DCP save: `FileSystemWriterAsync`, `save_state_dict_async_plan`,
`save_state_dict_async_finalize`, on torch.distributed.checkpoint's own writer and planner.

    writer = FileSystemWriterAsync(checkpoint_dir, thread_count=2)
    plan = save_state_dict_async_plan(state_dict, writer, None, 0, planner=DefaultSavePlanner())
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    queue.schedule_async_request(AsyncRequest(save_fn, save_args,
                                              [lambda: save_state_dict_async_finalize(*plan)]))

Phase 1, in the trainer (`save_state_dict_async_plan`): DCP's planning collectives, as
`torch.distributed.checkpoint.save` runs them, then `prepare_write_data` copies every item this
rank writes into new host memory (a device-to-host copy for CUDA tensors, a clone for CPU ones,
the bytes of a `BytesIO`): the caller may change its state once it returns. Phase 2, in the
background (`save_fn`): torch's `FileSystemWriter.write_data` writes those copies, so the files
are DCP's own and `FileSystemReader`/`dcp.load` read them. Phase 3, in the trainer
(`save_state_dict_async_finalize`, collective): the write results are gathered and the
coordinator writes the metadata file. Where NVRx writes in a separate process, the writes here
run in the queue's thread (torch's file writes release the GIL).

NVRx's metadata cache (`enable_cache`, `init_checkpoint_metadata_cache`) is accepted and said
to be unused: plans are made anew at every save, which costs the planning collectives only.
`use_msc=True` (NVIDIA's multi-storage client) is refused.
"""

from __future__ import annotations

import inspect
import io
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from ftrun.checkpointing.errors import CheckpointUsageError

logger = logging.getLogger("ftrun.checkpointing")
_said_no_cache = False


class FileSystemWriterAsync(FileSystemWriter):
    """torch's `FileSystemWriter` whose data is copied in `prepare_write_data` and written by
    `get_save_function_and_args()`'s function (see the module docstring)."""

    def __init__(self, path: Any, *args: Any, use_msc: bool = False, **kwargs: Any) -> None:
        if use_msc:
            raise CheckpointUsageError(
                "FileSystemWriterAsync(use_msc=True): the multi-storage client is not supported"
            )
        kwargs.pop("separation_hint", None)  # NVRx's file grouping hint: one file per thread
        super().__init__(path, *args, **kwargs)
        self._plan: SavePlan | None = None
        self._staged: dict[Any, Any] = {}
        self._results: list[WriteResult] | None = None

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Copy every item of this rank's final `plan` to new host memory, now."""
        self._plan, self._results = plan, None
        self._staged = {item.index: _host_copy(planner.resolve_data(item)) for item in plan.items}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the device-to-host copies have landed

    def get_save_function_and_args(self) -> tuple[Any, Any, list[Any]]:
        """NVRx's `(save_fn, preload_fn, save_args)`; `(None, None, [])` with nothing to write."""
        if self._plan is None or not self._plan.items:
            return None, None, []
        return self._write_staged, None, []

    def _write_staged(self) -> None:
        assert self._plan is not None
        future = FileSystemWriter.write_data(self, self._plan, _Staged(self._staged))
        future.wait()
        self._results = future.value()
        self._staged = {}

    def retrieve_write_results(self) -> list[WriteResult]:
        """The write results of `save_fn` (raises if it has not run)."""
        if self._plan is not None and self._plan.items and self._results is None:
            raise RuntimeError("the async write has not completed")
        return self._results or []


class _Staged(SavePlanner):
    """A planner that only resolves items to the copies taken in `prepare_write_data`."""

    def __init__(self, staged: dict[Any, Any]) -> None:
        self._staged = staged

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = self._staged[write_item.index]
        return io.BytesIO(data) if isinstance(data, bytes) else data

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
        raise NotImplementedError

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        raise NotImplementedError


def save_state_dict_async_plan(
    state_dict: dict[str, Any],
    storage_writer: FileSystemWriterAsync,
    process_group: Any = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    enable_cache: bool = False,
    metadata: Metadata | None = None,
) -> tuple[FileSystemWriterAsync, Metadata | None, _DistWrapper]:
    """Plan the save (collective when distributed) and stage this rank's data; returns what
    `save_state_dict_async_finalize` takes."""
    if enable_cache or metadata is not None:
        _say_no_cache()
    if not isinstance(storage_writer, FileSystemWriterAsync):
        raise CheckpointUsageError(
            f"storage_writer must be a FileSystemWriterAsync, not {type(storage_writer).__name__}"
        )
    wrapper = _DistWrapper(process_group, dist.is_available() and dist.is_initialized(),
                           coordinator_rank)  # fmt: skip
    planner = planner or DefaultSavePlanner()
    global_metadata: Metadata | None = None

    def local_step() -> SavePlan:
        planner.set_up_planner(state_dict, storage_writer.storage_meta(), wrapper.is_coordinator)
        if "kwargs" in inspect.signature(storage_writer.set_up_storage_writer).parameters:
            storage_writer.set_up_storage_writer(wrapper.is_coordinator, rank=wrapper.rank)
        else:
            storage_writer.set_up_storage_writer(wrapper.is_coordinator)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    def global_step(all_local_plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal global_metadata
        all_local_plans, global_metadata = planner.create_global_plan(all_local_plans)
        return storage_writer.prepare_global_plan(all_local_plans)

    central_plan = wrapper.reduce_scatter("plan", local_step, global_step)
    storage_writer.prepare_write_data(planner.finish_plan(central_plan), planner)
    return storage_writer, global_metadata, wrapper


def save_state_dict_async_finalize(
    storage_writer: FileSystemWriterAsync, global_metadata: Metadata | None, dist_wrapper: Any
) -> None:
    """Gather the write results and write the metadata on the coordinator (collective)."""
    results = dist_wrapper.gather_object(storage_writer.retrieve_write_results())
    if dist_wrapper.is_coordinator:
        if global_metadata is None:
            raise RuntimeError("the coordinator has no plan metadata")
        storage_writer.finish(global_metadata, results)
    dist_wrapper.barrier()


def init_checkpoint_metadata_cache(cached_global_metadata: Metadata | None = None) -> None:
    """NVRx's: plans are not cached here (see the module docstring)."""
    _say_no_cache()


def _say_no_cache() -> None:
    global _said_no_cache
    if not _said_no_cache:
        _said_no_cache = True
        logger.warning("DCP async save: NVRx's plan cache is not used: every save plans anew")


def _host_copy(data: Any) -> Any:
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    if isinstance(data, torch.Tensor):
        tensor = data.detach()
        return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")
    raise CheckpointUsageError(f"cannot stage a {type(data).__name__} for an async DCP save")
