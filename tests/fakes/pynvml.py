"""A fake `pynvml` for health-check tests (no GPU here): the only fake in the suite.

Driven by the FAKE_NVML environment variable, JSON: {"devices": N, "faults": {"INDEX":
["retired_pages" | "remapped_rows" | "ecc" | "nvlink" | "unreachable"]}}. Unset: no driver.
"""

from __future__ import annotations

import json
import os

NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 4
NVML_ERROR_INVALID_ARGUMENT = 2


class NVMLError(Exception):
    def __init__(self, value: int = 999) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


class NVMLError_NotSupported(NVMLError):
    pass


def _spec() -> dict:
    raw = os.environ.get("FAKE_NVML")
    if raw is None:
        raise NVMLError(12)  # NVML_ERROR_LIBRARY_NOT_FOUND
    return json.loads(raw)


def _faults(handle: int) -> list[str]:
    return _spec().get("faults", {}).get(str(handle), [])


def nvmlInit() -> None:
    _spec()


def nvmlShutdown() -> None:
    return None


def nvmlDeviceGetCount() -> int:
    return int(_spec()["devices"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if "unreachable" in _faults(index):
        raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST
    return index


def nvmlDeviceGetRetiredPagesPendingStatus(handle: int) -> int:
    return int("retired_pages" in _faults(handle))


def nvmlDeviceGetRemappedRows(handle: int) -> tuple[int, int, int, int]:
    return (0, 0, int("remapped_rows" in _faults(handle)), 0)


def nvmlDeviceGetTotalEccErrors(handle: int, _kind: int, _counter: int) -> int:
    return 3 if "ecc" in _faults(handle) else 0


def nvmlDeviceGetNvLinkState(handle: int, link: int) -> int:
    if link >= 2:
        raise NVMLError_NotSupported(3)
    return 0 if "nvlink" in _faults(handle) else NVML_FEATURE_ENABLED
