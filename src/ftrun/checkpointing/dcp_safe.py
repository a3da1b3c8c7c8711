"""The pieces of torch.distributed.checkpoint (DCP) the global tier plugs in: a stager that
reuses its buffers, and a reader and planner that never unpickle without an allowlist.

Where DCP (torch 2.13) unpickles on load, and what we do instead:

1. `FileSystemReader.read_metadata` reads `.metadata` with a plain `pickle.load` (the writer
   pickles the `Metadata` object): any global, so any code. `SafeFileSystemReader` reads it with
   `MetadataUnpickler`, whose `find_class` allows only DCP's metadata classes (the dataclasses
   in `torch.distributed.checkpoint.metadata`, `filesystem._StorageInfo`), `torch.Size`, torch
   dtypes and layouts, and `pathlib` paths; anything else is refused before it is looked up.
2. `DefaultLoadPlanner.load_bytes` reads every non-tensor value with
   `torch.load(weights_only=False)`. `SafeLoadPlanner` reads it with `weights_only=True`
   (torch's own allowlisting unpickler: containers, numbers, strings, tensors) and hands DCP the
   value re-encoded by us, so what reaches the unrestricted path is bytes we just made from
   allowlisted types.
3. Tensors: `FileSystemReader.read_data` already uses `torch.load(weights_only=True)`.

On top of that, the global tier checks every file against the manifest's CRC-32C before DCP
reads a byte, so what these unpicklers see is what the save wrote (CRC-32C detects damage, not
an attacker who can rewrite the manifest too: the allowlists are the defence there).

Staging: `async_save` stages the state in the caller. DCP's default copies every tensor into new
memory each time (page faults on every save); its `BlockingAsyncStager(cache_staged_state_dict=
True)` reuses buffers but always pins them (it fails on a machine without CUDA) and keeps the
first state's structure forever. `ReusingStager` reuses its buffers while the state's structure
(paths, shapes, dtypes, devices) stays the same, pins them only for CUDA tensors, and rebuilds
them when the structure changes. It uses the two helpers BlockingAsyncStager is made of
(`torch.distributed._state_dict_utils`, private: DTensor and ShardedTensor are handled there).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import AsyncStager

from ftrun.checkpointing.global_files import DCP_METADATA

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = frozenset(
    {
        *(
            (_METADATA_MODULE, name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `Metadata` and nothing else (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def load_metadata(stream: IO[bytes]) -> Metadata:
    """DCP's `Metadata` from a `.metadata` stream; `pickle.UnpicklingError` for anything else."""
    try:
        metadata = MetadataUnpickler(stream).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # truncated or garbled: one error type for the caller
        raise pickle.UnpicklingError(f"bad DCP metadata: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"DCP metadata is a {type(metadata).__name__}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's `FileSystemReader`, reading `.metadata` through `MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise NotImplementedError("per-rank metadata (use_collectives=False) is not used")
        with open(Path(self.path) / DCP_METADATA, "rb") as stream:
            metadata = load_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's `DefaultLoadPlanner`, reading non-tensor values with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        reencoded = io.BytesIO()
        torch.save(obj, reencoded)  # only allowlisted types in it: safe for the parent's load
        reencoded.seek(0)
        super().load_bytes(read_item, reencoded)


class ReusingStager(AsyncStager):
    """Stages into CPU buffers kept from the previous save while the structure is the same.

    The caller must not stage again before the write of the previous staged copy is done.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._signature: tuple[Any, ...] | None = None
        self._pinned = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = tuple(_signature(state_dict, ""))
        if self._cache is None or signature != self._signature:
            has_cuda = any(len(e) == 5 and e[4] == "cuda" for e in signature)  # tensor entries
            self._pinned = has_cuda and torch.cuda.is_available()
            self._cache = None  # drop the old buffers before allocating new ones
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=self._pinned)
            self._signature = signature
        staged = _copy_state_dict(state_dict, self._cache, non_blocking=self._pinned)
        if self._pinned:
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns once the copy is done."""

    def close(self) -> None:
        self._cache, self._signature = None, None


def _signature(obj: Any, path: str) -> list[tuple[Any, ...]]:
    """What decides whether staged buffers fit: every tensor's place, type, shape, dtype, device
    and every other value's place and type."""
    if isinstance(obj, torch.Tensor):
        return [(path, type(obj).__name__, tuple(obj.shape), str(obj.dtype), obj.device.type)]
    if isinstance(obj, Mapping):
        return [
            entry for key, value in obj.items() for entry in _signature(value, f"{path}/{key}")
        ] + [(path, "dict", len(obj))]
    if isinstance(obj, (list, tuple)):
        return [
            entry for i, value in enumerate(obj) for entry in _signature(value, f"{path}/{i}")
        ] + [(path, type(obj).__name__, len(obj))]
    return [(path, type(obj).__name__)]
