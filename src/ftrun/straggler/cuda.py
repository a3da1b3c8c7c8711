"""CUDA timing of sections with events, resolved later, never synchronizing.

A section's GPU time is the time between two events recorded on the current stream at its
entry and its exit: the span of the GPU work that the section queued (and any idle gap the GPU
had inside it). Events come from a pool and go back to it once resolved. `resolve` asks each
pending end event whether the GPU reached it (cudaEventQuery, which does not wait); one it has
not reached stays pending. The pending list is bounded: if the GPU falls that far behind, the
oldest unresolved section is dropped rather than waited for.

Two ways to make the CUDA calls: `RuntimeEvents` calls the CUDA runtime that torch loaded
directly (ctypes, on the raw current stream: about 1 us a call), `TorchEvents` goes through
`torch.cuda.Event` (its `record()` looks the current stream up through Python objects: about
12 us on an H100 host, measured by bench/monitor/straggler_gpu.py), used where the runtime
library is not found in the process.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

MAX_PENDING = 8192
_RECLAIM = 4
_NOT_READY = 600  # cudaErrorNotReady


class RuntimeEvents:
    """cudaEvent* calls on torch's own libcudart, on the current device's current stream."""

    def __init__(self, lib: ctypes.CDLL, torch: Any) -> None:
        vp = ctypes.c_void_p
        self._create = lib.cudaEventCreate
        self._create.argtypes = [ctypes.POINTER(vp)]
        self._record = lib.cudaEventRecord
        self._record.argtypes = [vp, vp]
        self._query = lib.cudaEventQuery
        self._query.argtypes = [vp]
        self._elapsed = lib.cudaEventElapsedTime
        self._elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
        self._destroy = lib.cudaEventDestroy
        self._destroy.argtypes = [vp]
        self._raw_stream = torch._C._cuda_getCurrentRawStream
        self._device = torch._C._cuda_getDevice
        self._ms = ctypes.c_float()

    @classmethod
    def find(cls, torch: Any) -> RuntimeEvents | None:
        """The runtime library torch loaded (read from /proc/self/maps), or None."""
        try:
            with open("/proc/self/maps", encoding="utf-8") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
            return cls(ctypes.CDLL(sorted(paths)[0]), torch) if paths else None
        except (OSError, AttributeError, IndexError):
            return None

    def new_event(self) -> int:
        handle = ctypes.c_void_p()
        if self._create(ctypes.byref(handle)) != 0:
            raise RuntimeError("cudaEventCreate failed")
        return handle.value  # type: ignore[return-value]

    def record(self, event: int) -> None:
        self._record(event, self._raw_stream(self._device()))

    def done(self, event: int) -> bool:
        return self._query(event) != _NOT_READY

    def elapsed_ms(self, start: int, end: int) -> float:
        self._elapsed(ctypes.byref(self._ms), start, end)
        return self._ms.value

    def destroy(self, event: int) -> None:
        self._destroy(event)


class TorchEvents:
    """The same through `torch.cuda.Event` (slower on the CPU)."""

    def __init__(self, torch: Any) -> None:
        self._event = torch.cuda.Event

    def new_event(self) -> Any:
        return self._event(enable_timing=True)

    def record(self, event: Any) -> None:
        event.record()

    def done(self, event: Any) -> bool:
        return event.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end)

    def destroy(self, event: Any) -> None:
        return None


class CudaTimer:
    """Event pairs of CUDA sections."""

    def __init__(self, events: RuntimeEvents | TorchEvents) -> None:
        self.events = events
        self._pool: list[Any] = []
        self._pending: list[tuple[Any, Any, Any]] = []  # (section, start, end)

    def start(self) -> Any:
        event = self._event()
        self.events.record(event)
        return event

    def stop(self, section: Any, start: Any) -> None:
        end = self._event()
        self.events.record(end)
        pending = self._pending
        pending.append((section, start, end))
        if len(pending) > MAX_PENDING:
            del pending[0]  # its events are dropped, not reused: they may still be queued

    def _event(self) -> Any:
        """A pooled event; with the pool empty, the oldest sections the GPU has finished are
        resolved first (they would be at the next flush anyway), so that short sections reuse
        events instead of creating new ones (cudaEventCreate costs more than a record)."""
        if not self._pool:
            self._reclaim(_RECLAIM)
        return self._pool.pop() if self._pool else self.events.new_event()

    def _reclaim(self, most: int) -> None:
        pending, events, done = self._pending, self.events, 0
        while done < most and done < len(pending) and events.done(pending[done][2]):
            self._finish(*pending[done])
            done += 1
        del pending[:done]

    def resolve(self) -> None:
        """Append the GPU time of every completed section to its `gpu` list."""
        kept = []
        for section, start, end in self._pending:
            if self.events.done(end):
                self._finish(section, start, end)
            else:
                kept.append((section, start, end))
        self._pending = kept

    def _finish(self, section: Any, start: Any, end: Any) -> None:
        """A completed section: its GPU time (ns) to its `gpu` list, its events to the pool."""
        section.gpu.append(int(self.events.elapsed_ms(start, end) * 1e6))
        self._pool += (start, end)

    def close(self) -> None:
        """Give the pooled events back (pending ones may still be queued: left alone)."""
        for event in self._pool:
            self.events.destroy(event)
        self._pool.clear()


def cuda_timer() -> CudaTimer | None:
    """A timer if torch is imported and CUDA is usable here, else None (CPU timing only)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()  # loads the runtime library, so that it can be found
        return CudaTimer(RuntimeEvents.find(torch) or TorchEvents(torch))
    except Exception:  # a broken driver install: time the CPU only
        return None
