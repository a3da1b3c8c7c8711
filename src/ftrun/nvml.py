"""The one place `pynvml` (from nvidia-ml-py) is loaded: lazily, since most dev machines have no
GPU, and at one boundary that tests replace with a fake module (tests/fakes/pynvml.py). Also the
GPU health readings that the agent's checks (`agent.node_services.health`, `health_watch`) and
the worker's (`inprocess.health_check`) share, so that each is read and worded once."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

_DEVICE_ENTRY = re.compile(r"\d+|GPU-.+|MIG-.+")


@dataclasses.dataclass(frozen=True)
class GpuSnapshot:
    """What the health watch (`agent.node_services.health_watch`) last read of one of its GPUs,
    for the metrics; None where NVML does not say."""

    gpu: int
    """NVML's index."""
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization: float | None = None
    """The share (0-1) of NVML's last sample period in which a kernel ran."""
    throttled: tuple[str, ...] = ()
    """The slowdown reasons in force (thermal, power brake)."""
    uncorrected_ecc: int | None = None
    """The volatile uncorrected ECC error count."""
    xids: int = 0
    """Xid events seen since the watch started."""


def load_nvml() -> Any:
    """The initialised `pynvml` module, or None without NVML (no driver, no GPUs)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


@contextlib.contextmanager
def nvml_session() -> Iterator[Any]:
    """`with nvml_session() as nvml:` the module (None without NVML), shut down at the end."""
    nvml = load_nvml()
    try:
        yield nvml
    finally:
        if nvml is not None:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()


def handle_of(nvml: Any, name: str) -> Any:
    """The NVML handle of a CUDA_VISIBLE_DEVICES entry (an index, a `GPU-` or `MIG-` UUID); a MIG
    instance counts as its GPU. LookupError for an entry of another form."""
    if name.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(name))
    if name.startswith("GPU-"):
        return nvml.nvmlDeviceGetHandleByUUID(name)
    if name.startswith("MIG-"):
        mig = nvml.nvmlDeviceGetHandleByUUID(name)
        return nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    raise LookupError(f"CUDA_VISIBLE_DEVICES entry {name!r} names no GPU")


def visible_gpus(nvml: Any, visible: str | None) -> list[tuple[int, Any]]:
    """(NVML index, handle) of each GPU that `visible`, a CUDA_VISIBLE_DEVICES value, names, in
    its order and once each (MIG instances of one GPU are that GPU); every GPU NVML sees when it
    is None. As CUDA does, the list ends at its first entry that names no device ("-1": none)."""
    if visible is None:
        count = nvml.nvmlDeviceGetCount()
        return [(index, nvml.nvmlDeviceGetHandleByIndex(index)) for index in range(count)]
    found: dict[int, Any] = {}
    for name in (entry.strip() for entry in visible.split(",")):
        if not _DEVICE_ENTRY.fullmatch(name):
            break
        handle = handle_of(nvml, name)
        found.setdefault(nvml.nvmlDeviceGetIndex(handle), handle)
    return list(found.items())


def supported(nvml: Any, query: str, *args: Any) -> Any:
    """`nvml.<query>(*args)`, or None where this pynvml, driver or device does not have it;
    other NVML errors are raised."""
    fn = getattr(nvml, query, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nvml.NVMLError as exc:
        unsupported = getattr(nvml, "NVMLError_NotSupported", ())
        invalid = getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", -1)
        if isinstance(exc, unsupported) or getattr(exc, "value", None) == invalid:
            return None  # e.g. an NVLink index beyond what this device has
        raise


Query = Callable[..., Any]
"""How a reading asks NVML: `(nvml, query name, *args)`, as `supported`."""


def memory_problems(nvml: Any, handle: Any, ask: Query = supported) -> list[str]:
    """The GPU's pages pending retirement and rows pending or failed remapping, worded for a
    health message (empty: none)."""
    problems = []
    if ask(nvml, "nvmlDeviceGetRetiredPagesPendingStatus", handle):
        problems.append("retired pages pending")
    rows = ask(nvml, "nvmlDeviceGetRemappedRows", handle)
    if rows and (rows[2] or rows[3]):  # (correctable, uncorrectable, pending, failed)
        problems.append("row remapping pending or failed")
    return problems


def uncorrected_ecc(nvml: Any, handle: Any, ask: Query = supported) -> int | None:
    """The GPU's volatile uncorrected ECC error count (None: not reported)."""
    kind, counter = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
    return ask(nvml, "nvmlDeviceGetTotalEccErrors", handle, kind, counter)


def nvlinks(nvml: Any, handle: Any) -> dict[int, bool]:
    """The GPU's NVLinks, each up or not (empty without NVLink: links the GPU does not have, or
    whose state NVML does not report, are left out)."""
    links = {}
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = supported(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        if state is not None:
            links[link] = state == getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    return links


def nvlinks_down(nvml: Any, handle: Any) -> list[int]:
    """The GPU's NVLinks that are not up (links it does not have are skipped)."""
    return [link for link, up in nvlinks(nvml, handle).items() if not up]


_NVLINK5_FIELDS = (215, 295, 208)
"""Per-link fields (scope: the link) on NVLink5: NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_EVENTS,
_PLR_XMIT_RETRY_BLOCKS and _COUNT_RCV_ERRORS."""
_VALUE = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
"""nvmlFieldValue_t's union member for each NVML_VALUE_TYPE."""


def nvlink_errors(
    nvml: Any, handle: Any, link: int, tier: int | None = None
) -> tuple[int, dict[int, int]] | None:
    """One NVLink's error counters, read as NVRx 0.7's NVLinkWindowHealthCheck reads them, from
    the first of its three tiers that answers (only `tier`, when given): (tier, {field or counter
    type: value}); None where none does. Tiers: 0, NVLink5's per-link fields; 1, the replay and
    recovery fields of links 0-5; 2, nvmlDeviceGetNvLinkErrorCounter's DL replay and recovery."""
    for number in range(3) if tier is None else (tier,):
        counters = _NVLINK_READS[number](nvml, handle, link)
        if counters:
            return number, counters
    return None


def _fields(nvml: Any, handle: Any, ids: list[Any]) -> dict[int, int]:
    try:
        values = nvml.nvmlDeviceGetFieldValues(handle, ids)
    except nvml.NVMLError:
        return {}
    return {int(v.fieldId): int(getattr(v.value, _VALUE.get(v.valueType, "ullVal")))
            for v in values if v.nvmlReturn == 0}  # fmt: skip


def _legacy_errors(nvml: Any, handle: Any, link: int) -> dict[int, int]:
    found = {}
    for counter in (getattr(nvml, "NVML_NVLINK_ERROR_DL_REPLAY", 0),
                    getattr(nvml, "NVML_NVLINK_ERROR_DL_RECOVERY", 1)):  # fmt: skip
        value = supported(nvml, "nvmlDeviceGetNvLinkErrorCounter", handle, link, counter)
        if value is not None:
            found[counter] = int(value)
    return found


_NVLINK_READS: tuple[Callable[[Any, Any, int], dict[int, int]], ...] = (
    lambda nvml, handle, link: _fields(nvml, handle, [(f, link) for f in _NVLINK5_FIELDS]),
    lambda nvml, handle, link: {} if link >= 6 else _fields(nvml, handle, [  # L0..L5 only
        getattr(nvml, f"NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_L{link}", 46 + link),
        getattr(nvml, f"NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_L{link}", 53 + link)]),
    _legacy_errors,
)  # fmt: skip
