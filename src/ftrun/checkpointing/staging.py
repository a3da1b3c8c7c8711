"""Device staging for overlapped saves: the state's CUDA tensors copied into GPU buffers of
the save's own, so the training may change its tensors as soon as that copy ran.

Without staging, an overlapped save's device-to-host copies read the live tensors, so the next
optimizer step waits until they have landed in node memory: with 1.8 GB of state a PCIe copy
takes about as long as a forward and backward pass, and what is left of it stalls the step. A
copy into GPU memory takes a few milliseconds of HBM bandwidth; the optimizer then waits only
for it (a stream wait, never a host wait), and the copy to node memory reads the staged
buffers while the training goes on. The buffers are reused save after save (the next save
joins the previous one first), so they cost the state's CUDA bytes once.

It is not the default: measured on an H100 (bench/RESULTS.md, "Snapshot stall"), the 151M
script's copies to page-locked node memory finish within its forward and backward pass, so the
optimizer hardly waits for them, while staging adds its own HBM copy and the caller's walk of
the state (DDP +1.3 % a step straight to node memory, +5.6 % staged; FSDP2 +9.5 %, +15.2 %).
It pays where the PCIe copy outlasts a forward and backward pass: a large state, short steps.

Staging needs the state's CUDA bytes plus a margin (`STAGING_MARGIN` of the device, at least
1 GiB) free, counting what PyTorch's allocator holds unused; where they do not fit, the saves
go straight to node memory, said once. Host tensors in a staged save are cloned by the caller
(a CPU optimizer's step counters, RNG states); a state with more than `HOST_CLONE_LIMIT` bytes
of them is not staged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import torch

from ftrun.checkpointing.errors import CheckpointUsageError

logger = logging.getLogger(__name__)

Staging = Literal["host", "device"]
STAGINGS: tuple[str, ...] = ("host", "device")
STAGING_MARGIN = 0.05
"""The share of the device's memory staging leaves free (at least 1 GiB)."""
HOST_CLONE_LIMIT = 64 * 2**20


class DeviceStaging:
    """GPU buffers for one rank's state, reused across saves; `stage` copies into them.
    `mode`: "device" (when they fit in free memory) or "host" (never)."""

    def __init__(self, mode: Staging = "host") -> None:
        if mode not in STAGINGS:
            raise CheckpointUsageError(
                f"staging must be one of {', '.join(STAGINGS)}, not {mode!r}"
            )
        self.mode = mode
        self._buffers: list[torch.Tensor] = []

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def stage(self, state: Any) -> tuple[Any, Any] | None:
        """(`state` with its CUDA tensors replaced by staged copies and its host tensors by
        clones, the CUDA event after which the copies are complete), or None when the state
        is not staged (nothing on one CUDA device, mode "host", too little free memory, too
        many host bytes). The copies run on a side stream after the current stream's work."""
        if self.mode == "host":
            return None
        sources: dict[tuple[Any, ...], torch.Tensor] = {}
        host_bytes = [0]
        _walk(state, lambda t: _collect(t, sources, host_bytes))
        devices = {t.device for t in sources.values()}
        if len(devices) != 1 or host_bytes[0] > HOST_CLONE_LIMIT:
            return None
        device = devices.pop()
        if not self._fit(list(sources.values()), device):
            return None
        staged = dict(zip(sources, self._buffers, strict=True))
        stream = _staging_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            torch._foreach_copy_(self._buffers, list(sources.values()))
            done = torch.cuda.Event()
            done.record(stream)
        for source in sources.values():
            source.record_stream(stream)  # not freed and reused before the copy ran
        return _walk(state, lambda t: _replacement(t, staged)), done

    def _fit(self, sources: list[torch.Tensor], device: torch.device) -> bool:
        """Buffers shaped as `sources`, reusing the held ones when they match; False (and none
        held) when they do not fit in free memory."""
        if [_shape(b) for b in self._buffers] == [_shape(s) for s in sources]:
            return True
        self._buffers = []
        needed = sum(s.numel() * s.element_size() for s in sources)
        if not fits_on_device(needed, device):
            gib = needed / 2**30
            logger.info("snapshots staged in host memory from now on: %.2f GiB of state "
                        "does not fit in free GPU memory with a margin", gib)  # fmt: skip
            self.mode = "host"  # not asked again every step
            return False
        self._buffers = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in sources]
        return True


def fits_on_device(needed: int, device: torch.device) -> bool:
    """Whether `needed` bytes fit in `device`'s free memory (what the driver has free and what
    PyTorch's allocator holds unused), leaving the margin."""
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return needed + max(STAGING_MARGIN * total, 2**30) <= free + unused


def _walk(value: Any, visit: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with each tensor replaced by `visit(tensor)` (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return visit(value)
    if isinstance(value, dict):
        return {key: _walk(item, visit) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_walk(item, visit) for item in value)
    return value


def _stageable(tensor: torch.Tensor) -> bool:
    """A plain dense tensor whose bytes describe it (what a part can hold; the rest is left
    for the part's own checks to refuse)."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not (tensor.is_conj() or tensor.is_neg())
        and tensor.numel() > 0
    )


def _key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Views of the same bytes (tied weights) get one buffer, as the part stores them once."""
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _collect(tensor: torch.Tensor, sources: dict[tuple[Any, ...], torch.Tensor],
             host_bytes: list[int]) -> None:  # fmt: skip
    if tensor.is_cuda and _stageable(tensor):
        sources.setdefault(_key(tensor), tensor.detach())
    elif not tensor.is_cuda:
        host_bytes[0] += tensor.numel() * tensor.element_size()


def _replacement(tensor: torch.Tensor, staged: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    if tensor.is_cuda:
        return staged.get(_key(tensor), tensor) if _stageable(tensor) else tensor
    return tensor.detach().clone()


def _shape(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(tensor.shape), tensor.dtype)


_streams: dict[torch.device, Any] = {}


def _staging_stream(device: torch.device) -> Any:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]
