"""Page-locking a part's mapping, so that CUDA tensors are copied into it at the bus's speed.

A device-to-host copy into pageable memory goes through the driver's own small pinned buffer (a
DMA, then a host memcpy, chunk by chunk): 10 GB/s against 55 GB/s into pinned memory, for an 8
GiB state on an H100 (bench/checkpoint/checkpoint_gpu.py). A mapping in node memory (/dev/shm)
that the store keeps for later saves (`keep_mapping`, a recycled file's) is page-locked once
with `cudaHostRegister`; its copies are then `non_blocking` DMAs straight into the file's pages,
one synchronize per device before `prepare_part` returns. One-shot mappings (closed at `commit`)
are not registered: pinning every page of a new mapping, to unpin it at once, buys nothing; nor
are mappings of files on disk (cudaHostRegister of a shared mapping of an ext4 file failed,
error 1, where tmpfs worked, on Linux 6.18: writable long-term pins of disk files are refused).

`Mapping` is the mmap `part_write` writes parts through: it unregisters itself before it is closed
or freed (the driver keeps registered pages pinned, and their range registered, past an munmap).
Nothing here calls CUDA unless a part holds CUDA tensors, so CPU-only torch never does.

Registration can fail (locked-memory limits, a driver or VM that refuses it): the copies then
go through pageable memory as before, said once per process in the log, and no later mapping
is registered. CUDA keeps a failed call as its "last error", which torch's next kernel launch
check would raise as its own: it is read back (reset) at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current device's
_disabled = False  # a registration failed: copy through pageable memory from now on


class Mapping(mmap.mmap):
    """An mmap that, if page-locked (`pin`), unregisters itself before it is unmapped."""

    _pinned: tuple[int, int] | None = None
    """(CUDA device, address) it was registered under; None: not registered."""

    def close(self) -> None:
        unpin(self)
        super().close()

    def __del__(self) -> None:  # runs before mmap's own dealloc unmaps it
        if not sys.is_finalizing():  # at exit, the driver unpins what the process held
            unpin(self)


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The CUDA devices that `tensors` live on (attribute reads only: no CUDA call)."""
    return list(dict.fromkeys(t.device for t in tensors if t.is_cuda))


def pin(mapping: mmap.mmap, device: torch.device) -> bool:
    """Page-lock `mapping` (once: later calls return at once); False if it cannot be."""
    if not isinstance(mapping, Mapping):
        return False
    if mapping._pinned is not None:
        return True
    if _disabled or mapping.closed or len(mapping) == 0:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the export ends here
    with torch.cuda.device(device):
        error = _register(address, len(mapping))
        if error == 0:
            mapping._pinned = (torch.cuda.current_device(), address)
            return True
        _clear_last_error()
    _disable(error)
    return False


def unpin(mapping: mmap.mmap) -> None:
    """Unregister `mapping` if `pin` registered it; the mapping itself stays."""
    pinned = getattr(mapping, "_pinned", None)
    if pinned is None:
        return
    assert isinstance(mapping, Mapping)
    mapping._pinned = None
    device, address = pinned
    with torch.cuda.device(device):
        error = int(torch.cuda.cudart().cudaHostUnregister(address))
        if error != 0:
            _clear_last_error()
            logger.warning("cudaHostUnregister of a checkpoint mapping failed: error %d", error)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the copies queued on each device's current stream."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _register(address: int, size: int) -> int:
    """cudaHostRegister's error code (0: success); a seam for tests to fail."""
    return int(torch.cuda.cudart().cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE))


def _disable(error: int) -> None:
    global _disabled
    _disabled = True
    logger.warning(
        "cannot page-lock checkpoint memory (cudaHostRegister: error %d): CUDA tensors are "
        "copied through pageable memory, more slowly",
        error,
    )


def _clear_last_error() -> None:
    """Reset CUDA's "last error" (cudaGetLastError) in the runtime that torch uses."""
    library = _cudart_library()
    if library is not None:
        library.cudaGetLastError()
        return
    with contextlib.suppress(RuntimeError):  # a static runtime: a launch check reads and resets it
        torch.ones(1, device=torch.cuda.current_device()).add_(1)


@functools.cache
def _cudart_library() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch links it dynamically), if any."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "/libcudart.so" in fields[5]:
                return ctypes.CDLL(fields[5].strip())
    return None
