"""The `health_check` hook (NVRx's `inprocess.health_check`): run on each rank after a fault,
before the restart, to keep an unhealthy rank out of it.

A rank's check is local: peers may be dead or still unwinding. Unhealthy is an exception; the
wrapper re-raises it and the process ends. `default_health_checks` is the chain the wrapper
runs: the user's check, then the GPU, NVLink and NIC checks of the GPU this rank uses.

ftrun: "the GPU this rank uses" is the calling thread's current CUDA device, and a rank that has
not initialized CUDA (a CPU/gloo job) uses none, so its checks pass without touching CUDA or
NVML. NVRx checks GPU `LOCAL_RANK`, which fails local rank 1 of a CPU job on a one-GPU host.
"""

from __future__ import annotations

import abc
import datetime
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ftrun.aside import Aside
from ftrun.infiniband import IB_ROOT, PCI_ROOT, ib_ports_down, nearest_ib_device
from ftrun.inprocess import exception
from ftrun.inprocess.compose import Compose
from ftrun.inprocess.state import FrozenState, Hook
from ftrun.nvml import memory_problems, nvlinks_down, supported

log = logging.getLogger("ftrun.inprocess")


class HealthCheck(Hook):
    """Raises if this rank must not take part in the restart; compose several with
    `Compose`."""


class HealthCheckTimeoutError(exception.HealthCheckError, exception.TimeoutError):
    """A check did not finish in time: both unhealthy and a timeout, for either `except`."""


class CudaHealthCheck(HealthCheck):
    """Synchronizes the CUDA device this rank uses (the calling thread's current device), at
    most `timeout`, then once more to see the context still works. Passes at once when CUDA
    was never initialized in this process.

    ftrun: a CUDA error is a `HealthCheckError` and a timeout a `HealthCheckTimeoutError`
    (NVRx lets the CUDA error through as it is); the device is not taken from LOCAL_RANK.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> None:
        self.timeout = timeout

    def __call__(self, state: FrozenState) -> FrozenState:
        if not torch.cuda.is_initialized():
            return state
        device = torch.cuda.current_device()
        # Pending kernels cannot be cancelled: waiting for them, bounded, is the only way to
        # learn whether the context survived the fault.
        sync = Aside(lambda: torch.cuda.synchronize(device), "ftrun-cuda-health")
        if not sync.done(self.timeout.total_seconds()):
            raise HealthCheckTimeoutError(f"cuda:{device} did not synchronize in {self.timeout}")
        try:
            sync.result()
            torch.cuda.synchronize(device)  # a context broken by the first sync fails here
        except Exception as exc:
            raise exception.HealthCheckError(f"cuda:{device} is unhealthy: {exc}") from exc
        return state


class FaultCounterExceeded(exception.RestartError):
    """This rank has caused more faults than `FaultCounter.max_rank_faults` allows."""


class FaultCounter(HealthCheck):
    """Counts the iterations in which this rank's wrapped function raised; raises
    `FaultCounterExceeded` once the count exceeds `max_rank_faults` (None: never)."""

    def __init__(self, max_rank_faults: int | None = None) -> None:
        self.max_rank_faults = max_rank_faults
        self.faults_count = 0

    def __call__(self, state: FrozenState) -> FrozenState:
        if state.fn_exception is None:
            return state
        self.faults_count += 1
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(f"{self.faults_count} faults on this rank, at most "
                                       f"{self.max_rank_faults} allowed")  # fmt: skip
        return state


class _NvmlHealthCheck(HealthCheck):
    """NVML checks of the rank's GPU: `device_index` is an NVML index; None means the GPU this
    rank uses (none without CUDA: pass). Passes where NVML is not there."""

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = device_index

    def __call__(self, state: FrozenState) -> FrozenState:
        if self.device_index is None and not torch.cuda.is_initialized():
            return state
        from ftrun.nvml import nvml_session

        with nvml_session() as nvml:
            if nvml is None:
                return state
            try:
                handle = _nvml_handle(nvml, self.device_index)
                self.check(nvml, handle)
            except nvml.NVMLError as exc:
                raise exception.HealthCheckError(f"{self._name()}: NVML failed: {exc}") from exc
        return state

    @abc.abstractmethod
    def check(self, nvml: Any, handle: Any) -> None:
        """Raise HealthCheckError if the device behind `handle` is unhealthy."""

    def _name(self) -> str:
        where = "this rank's GPU" if self.device_index is None else f"GPU {self.device_index}"
        return f"{type(self).__name__} ({where})"


class ChainedGPUHealthCheck(_NvmlHealthCheck):
    """The GPU answers NVML and has no page retirement or row remapping pending or failed, and
    NVML asks for no recovery action (reset, reboot, drain) where the driver reports one.

    ftrun: NVRx reads the recovery action only; pending retirements/remaps mean the same.
    """

    def check(self, nvml: Any, handle: Any) -> None:
        problems = memory_problems(nvml, handle)
        if action := _recovery_action(nvml, handle):
            problems.append(f"NVML recovery action {action} required")
        if problems:
            raise exception.HealthCheckError(f"{self._name()}: {', '.join(problems)}")


class ChainedNVLHealthCheck(_NvmlHealthCheck):
    """Reads the state of the GPU's NVLinks; a link that is not up is logged as a warning and
    does not fail the rank (as NVRx, which ignores this check's verdict)."""

    def check(self, nvml: Any, handle: Any) -> None:
        if down := nvlinks_down(nvml, handle):
            log.warning("%s: NVLink(s) %s not up", self._name(), down)


class ChainedNicHealthCheck(_NvmlHealthCheck):
    """Every port of the rank's InfiniBand NIC (the one nearest its GPU in the PCI tree) is
    ACTIVE. Passes without InfiniBand, or when no single NIC is nearest (no NIC is the rank's).

    ftrun: reads the port state only (NVRx also watches the link_downed counter); the node
    agent's NIC check (`infiniband.check_ib_ports`) covers every port and its counters.
    """

    ib_root = IB_ROOT
    pci_root = PCI_ROOT

    def check(self, nvml: Any, handle: Any) -> None:
        info = supported(nvml, "nvmlDeviceGetPciInfo", handle)
        bus_id = getattr(info, "busId", None)
        if not bus_id:
            return
        nic = nearest_ib_device(_sysfs_bus_id(bus_id), self.ib_root, self.pci_root)
        if nic is None:
            return
        if down := ib_ports_down(os.path.join(self.ib_root, nic)):
            raise exception.HealthCheckError(f"{self._name()}: {nic} port(s) {down} not ACTIVE")


def default_health_checks(user_check: Callable[[FrozenState], FrozenState] | None) -> Compose:
    """The chain the wrapper runs before a restart: the user's check (a Compose unpacked into
    its stages), then the GPU, NVLink and NIC checks of this rank's GPU."""
    checks: list[Callable[[FrozenState], FrozenState]] = []
    if isinstance(user_check, Compose):
        checks.extend(user_check.instances)
    elif user_check is not None:
        checks.append(user_check)
    checks += [ChainedGPUHealthCheck(), ChainedNVLHealthCheck(), ChainedNicHealthCheck()]
    return Compose(*checks)


def _nvml_handle(nvml: Any, device_index: int | None) -> Any:
    """The NVML handle of an NVML index, or of this thread's CUDA device, found by UUID since
    CUDA and NVML number devices differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER)."""
    if device_index is not None:
        return nvml.nvmlDeviceGetHandleByIndex(device_index)
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    if uuid.startswith(("GPU-", "MIG-")):
        uuid = uuid[4:]
    try:
        return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except nvml.NVMLError:
        mig = nvml.nvmlDeviceGetHandleByUUID(f"MIG-{uuid}")  # a MIG instance: check its GPU
        return nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)


def _recovery_action(nvml: Any, handle: Any) -> int:
    """NVML's GPU recovery action (0: none needed) where the driver reports it."""
    field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field is None:
        return 0
    values = supported(nvml, "nvmlDeviceGetFieldValues", handle, [field])
    if not values or getattr(values[0], "nvmlReturn", 0) != 0:
        return 0
    action = int(values[0].value.uiVal)
    return 0 if action == getattr(nvml, "NVML_GPU_RECOVERY_ACTION_NONE", 0) else action


def _sysfs_bus_id(nvml_bus_id: str | bytes) -> str:
    """NVML's "00000000:07:00.0" as sysfs names it: "0000:07:00.0"."""
    text = nvml_bus_id.decode() if isinstance(nvml_bus_id, bytes) else nvml_bus_id
    domain, _, rest = text.strip().lower().partition(":")
    return f"{domain[-4:]}:{rest}"
