"""A fake `pynvml` for health-check and NUMA tests (no GPU here): the only fake in the suite.

Driven by the FAKE_NVML environment variable, JSON: {"devices": N, "faults": {"INDEX":
["retired_pages" | "remapped_rows" | "ecc" | "nvlink" | "unreachable"]}}. Unset: no driver.
For `--numa-binding`, optionally: "cpu_affinity" and "mem_affinity": {"INDEX": {"node":
CPULIST, "socket": CPULIST}} (a device or scope left out: NVML_ERROR_NOT_SUPPORTED), and
"uuids": {"GPU-...": INDEX, "MIG-...": INDEX} (a MIG instance's parent is that GPU).
For the health watch: "xid_file": PATH, whose lines "INDEX XID" are the Xid events (a test
appends one while the job trains), "throttle": {"INDEX": clock-event reason bits},
"event_error": an NVML error code the event wait raises (other than its timeout), "memory":
{"INDEX": [USED, TOTAL]} (bytes) and "utilization": {"INDEX": PERCENT} (left out: not supported).
NVLink: "nvlinks": links each GPU has (default 2; 0: none, its state NOT_SUPPORTED), "nvlink"
among a GPU's faults: its links are down, "nvlink_errors": {"INDEX": {"LINK": COUNT}}: each
link's recovery-events counter (NVLink5's per-link field 215; the other two: NOT_SUPPORTED), or,
with "nvlink_legacy": true, its DL replay count from nvmlDeviceGetNvLinkErrorCounter only.
"""

from __future__ import annotations

import json
import os

NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 4
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_FOUND = 6
NVML_AFFINITY_SCOPE_NODE = 0
NVML_AFFINITY_SCOPE_SOCKET = 1
_SCOPES = {NVML_AFFINITY_SCOPE_NODE: "node", NVML_AFFINITY_SCOPE_SOCKET: "socket"}


class NVMLError(Exception):
    def __init__(self, value: int = 999) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


nvmlEventTypeXidCriticalError = 0x8
_xids_read = 0
"""Lines of the xid file already returned as events."""


class _EventData:
    def __init__(self, device: int, xid: int) -> None:
        self.device, self.eventType, self.eventData = device, nvmlEventTypeXidCriticalError, xid


def nvmlEventSetCreate() -> list[int]:
    return []


def nvmlDeviceRegisterEvents(handle: int, _types: int, event_set: list[int]) -> None:
    event_set.append(handle)


def nvmlEventSetWait_v2(event_set: list[int], _timeout_ms: int) -> _EventData:
    """The next Xid of the file from a device registered with `event_set` (NVML's: an event
    set hears only its devices)."""
    global _xids_read
    if "event_error" in _spec():  # e.g. 15: NVML_ERROR_GPU_IS_LOST
        raise NVMLError(int(_spec()["event_error"]))
    path = _spec().get("xid_file")
    lines = []
    if path and os.path.exists(path):
        with open(path) as f:
            lines = [line.split() for line in f if line.strip()]
    while _xids_read < len(lines):
        index, xid = lines[_xids_read]
        _xids_read += 1
        if int(index) in event_set:
            return _EventData(int(index), int(xid))
    raise NVMLError_Timeout(10)


def nvmlEventSetFree(_event_set: list[int]) -> None:
    return None


def nvmlDeviceGetIndex(handle: int) -> int:
    return handle


class _Memory:
    def __init__(self, used: int, total: int) -> None:
        self.used, self.total, self.free = used, total, total - used


class _Rates:
    def __init__(self, gpu: int) -> None:
        self.gpu, self.memory = gpu, 0


def nvmlDeviceGetMemoryInfo(handle: int) -> _Memory:
    used_total = _spec().get("memory", {}).get(str(handle))
    if used_total is None:
        raise NVMLError_NotSupported(3)
    return _Memory(*used_total)


def nvmlDeviceGetUtilizationRates(handle: int) -> _Rates:
    percent = _spec().get("utilization", {}).get(str(handle))
    if percent is None:
        raise NVMLError_NotSupported(3)
    return _Rates(int(percent))


def nvmlDeviceGetCurrentClocksEventReasons(handle: int) -> int:
    return int(_spec().get("throttle", {}).get(str(handle), 0))


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
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
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
    if link >= int(_spec().get("nvlinks", 2)):
        raise NVMLError_NotSupported(3)
    return 0 if "nvlink" in _faults(handle) else NVML_FEATURE_ENABLED


class _FieldValue:
    def __init__(self, field: int, value: int | None) -> None:
        self.fieldId, self.valueType = field, 3  # NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        self.nvmlReturn = 3 if value is None else 0  # NVML_ERROR_NOT_SUPPORTED, NVML_SUCCESS
        self.value = type("value", (), {"ullVal": value or 0})()


def _link_errors(handle: int, link: int) -> int:
    return int(_spec().get("nvlink_errors", {}).get(str(handle), {}).get(str(link), 0))


def nvmlDeviceGetFieldValues(handle: int, ids: list) -> list[_FieldValue]:
    """Field 215 scoped to a link (NVLink5's recovery events); every other field: not supported."""
    if _spec().get("nvlink_legacy"):
        raise NVMLError_NotSupported(3)
    values = []
    for field in ids:
        fid, link = field if isinstance(field, tuple) else (field, None)
        counted = fid == 215 and link is not None and link < int(_spec().get("nvlinks", 2))
        values.append(_FieldValue(fid, _link_errors(handle, link) if counted else None))
    return values


def nvmlDeviceGetNvLinkErrorCounter(handle: int, link: int, counter: int) -> int:
    if counter != 0 or link >= int(_spec().get("nvlinks", 2)):  # NVML_NVLINK_ERROR_DL_REPLAY
        raise NVMLError_NotSupported(3)
    return _link_errors(handle, link)


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> int:
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    index = _spec().get("uuids", {}).get(text)
    if index is None:
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return nvmlDeviceGetHandleByIndex(int(index))


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: int) -> int:
    return handle  # the fake's MIG handles are their GPU's


def nvmlDeviceGetCpuAffinityWithinScope(handle: int, size: int, scope: int) -> list[int]:
    return _mask("cpu_affinity", handle, size, scope)


def nvmlDeviceGetCpuAffinity(handle: int, size: int) -> list[int]:
    return _mask("cpu_affinity", handle, size, NVML_AFFINITY_SCOPE_NODE)


def nvmlDeviceGetMemoryAffinity(handle: int, size: int, scope: int) -> list[int]:
    return _mask("mem_affinity", handle, size, scope)


def _mask(key: str, handle: int, size: int, scope: int) -> list[int]:
    """`size` 64-bit words with the bits of the spec's cpulist set, as NVML fills them."""
    cpulist = _spec().get(key, {}).get(str(handle), {}).get(_SCOPES[scope])
    if cpulist is None:
        raise NVMLError_NotSupported(3)
    words = [0] * size
    for part in filter(None, cpulist.split(",")):
        low, _, high = part.partition("-")
        for item in range(int(low), int(high or low) + 1):
            if item < 64 * size:
                words[item // 64] |= 1 << (item % 64)
    return words
