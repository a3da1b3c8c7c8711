"""Node health while the workers run: a node service that reads NVML (and the InfiniBand
link_downed counters) every `--ft-health-interval` seconds.

What it reads, per GPU:
- Xid events, through an NVML event set registered for critical Xids (drained without waiting);
- the volatile uncorrected ECC count, against its value when the cycle started;
- pages pending retirement, rows pending remapping or failed to remap;
- the clock-event (throttle) reasons: thermal slowdown (hardware or software) and power brake;
- with `--ft-gpu-health-check-nvlink`, each NVLink's state and error counters (`nvlink_window`:
  NVRx's NVLinkWindowHealthCheck): a link that went down, or errors in more than 15 of the
  last 30 minutes, is a fault.

With the NIC check on, it also reads every InfiniBand port's link_downed counter against the
cycle's start (a link that went down and up again while NCCL used it).

A *fault* (an Xid the driver attributes to hardware, a new uncorrected ECC error, a pending
retirement or remap, a link that went down) goes to the agent's inbox as a `HealthFinding`;
the policy applies `--ft-health-action`. A *degradation* (throttling) is logged and written as
an event once per cycle and reason: it slows the job, it does not break it. Xids that report
the application's own errors (13, 31, 43, 45: an illegal access, an MMU fault, a kernel that
was stopped) are findings, not faults: the worker's own failure says more.

The poll runs in this service's thread, never on the workers' CPUs' critical path: one
`nvmlDevice*` call per reading, each a few microseconds (bench/RESULTS.md, "health watch").
Its own cost is written with the cycle's `health_watch` event (polls, mean and max).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ftrun.agent.decisions.attribution import Signature, health_signature
from ftrun.agent.node_services.nvlink_window import LinkWindows
from ftrun.config.agent import HealthCheckConfig
from ftrun.errors import NodeUnhealthyError
from ftrun.infiniband import check_ib_ports
from ftrun.nvml import (
    GpuSnapshot,
    load_nvml,
    memory_problems,
    nvlink_errors,
    nvlinks,
    uncorrected_ecc,
    visible_gpus,
)
from ftrun.rendezvous.ranks import Round
from ftrun.services import Emit, NodeService, Post

log = logging.getLogger("ftrun.agent")

APPLICATION_XIDS = frozenset({13, 31, 43, 45})
"""Xids that report the application's own error (graphics exception, MMU fault, stopped
kernel, preemptive cleanup): not a reason to leave a node."""
_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
_NVML_ERROR_TIMEOUT = 10
_THROTTLES = {0x40: "hardware thermal slowdown", 0x20: "software thermal slowdown",
              0x80: "hardware power brake slowdown"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HealthFinding:
    """What the watch found; goes to the agent's inbox when it is a fault."""

    signature: Signature
    fault: bool
    gpu: int | None = None


@dataclasses.dataclass
class _PollCost:
    polls: int = 0
    total: float = 0.0
    worst: float = 0.0

    def add(self, seconds: float) -> None:
        self.polls += 1
        self.total += seconds
        self.worst = max(self.worst, seconds)


class GpuReadings:
    """One NVML session's readings of this launcher's GPUs (`visible`, its CUDA_VISIBLE_DEVICES;
    None: every GPU): with two launchers on one host, each watches its own, and an Xid on the
    other's GPU is not its fault. The baseline is taken per cycle; the NVLink windows (`nvlink`
    on) span cycles, timed by `clock`."""

    def __init__(
        self,
        nvml: Any,
        visible: str | None = None,
        nvlink: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml, self._clock = nvml, clock
        self._gpus = visible_gpus(nvml, visible)  # (NVML index, handle)
        self._links = {i: list(nvlinks(nvml, h)) for i, h in self._gpus} if nvlink else {}
        self._windows = LinkWindows()
        self._tiers: dict[tuple[int, int], int] = {}  # the tier that read each link
        self._events = nvml.nvmlEventSetCreate()
        for index, handle in self._gpus:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, _XID_CRITICAL, self._events)
            except nvml.NVMLError as exc:  # e.g. not supported on this GPU or driver
                log.warning("health watch: no Xid events from GPU %d (%s)", index, exc)
        self._ecc: dict[int, int] = {}
        self._told: set[tuple[int, str]] = set()
        self._xid_counts: dict[int, int] = {}
        self.latest: tuple[GpuSnapshot, ...] = ()

    def start_cycle(self) -> None:
        self._ecc = {i: uncorrected_ecc(self._nvml, h, _optional) or 0 for i, h in self._gpus}
        self._told.clear()
        self.xids()  # events from before this cycle belong to the pre-round check

    def read(self) -> list[HealthFinding]:
        """The poll's new findings; `latest` then holds what it read of each GPU."""
        found = self.xids()
        snapshots = []
        for index, handle in self._gpus:
            findings, snapshot = self._device(index, handle)
            found += findings
            snapshots.append(snapshot)
        self.latest = tuple(snapshots)  # one reference swap: a scrape reads it from its thread
        return [f for f in found if self._new(f)]

    def xids(self) -> list[HealthFinding]:
        nvml, found = self._nvml, []
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != _NVML_ERROR_TIMEOUT:  # not "nothing pending"
                    found.append(HealthFinding(health_signature("NVML event wait failed",
                                                                str(exc)), True))  # fmt: skip
                return found
            xid, gpu = int(data.eventData), _index(nvml, data.device)
            self._xid_counts[gpu] = self._xid_counts.get(gpu, 0) + 1
            fault = xid not in APPLICATION_XIDS
            found.append(HealthFinding(health_signature(f"Xid {xid}", f"GPU {gpu}"), fault, gpu))

    def _device(self, index: int, handle: Any) -> tuple[list[HealthFinding], GpuSnapshot]:
        nvml, found = self._nvml, []
        ecc = uncorrected_ecc(nvml, handle, _optional)
        if ecc is not None and ecc > self._ecc.get(index, 0):
            found.append(self._fault(index, "uncorrected ECC errors",
                                     f"{self._ecc.get(index, 0)} -> {ecc}"))  # fmt: skip
        found += [self._fault(index, what) for what in memory_problems(nvml, handle, _optional)]
        found += self._nvlink(index, handle)
        reasons = _optional(nvml, "nvmlDeviceGetCurrentClocksEventReasons", handle)
        throttled = tuple(name for bit, name in _THROTTLES.items() if reasons and reasons & bit)
        found += [HealthFinding(health_signature(name, f"GPU {index}"), False, index)
                  for name in throttled]  # fmt: skip
        memory = _optional(nvml, "nvmlDeviceGetMemoryInfo", handle)
        rates = _optional(nvml, "nvmlDeviceGetUtilizationRates", handle)
        return found, GpuSnapshot(
            index, memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization=None if rates is None else rates.gpu / 100, throttled=throttled,
            uncorrected_ecc=ecc, xids=self._xid_counts.get(index, 0),
        )  # fmt: skip

    def _nvlink(self, index: int, handle: Any) -> list[HealthFinding]:
        """The GPU's NVLinks that are down, and those whose error counters rose in more of the
        latest windows than the threshold (`nvlink_window`)."""
        now, down, bad = self._clock(), [], []
        up = getattr(self._nvml, "NVML_FEATURE_ENABLED", 1)
        for link in self._links.get(index, ()):
            if _optional(self._nvml, "nvmlDeviceGetNvLinkState", handle, link) not in (up, None):
                down.append(str(link))
            read = nvlink_errors(self._nvml, handle, link, self._tiers.get((index, link)))
            if read is None:  # no reading: the link's windows wait (NVRx's)
                continue
            self._tiers[(index, link)], counters = read
            flagged = self._windows.add(now, (index, link), counters)
            if self._windows.bad(flagged):
                bad.append(f"link {link}: {flagged} of {self._windows.windows} windows")
        found = [self._fault(index, "NVLink down", f"link {', '.join(down)}")] if down else []
        if bad:
            found.append(self._fault(index, "NVLink errors", "; ".join(bad)))
        return found

    def _fault(self, index: int, what: str, reading: str = "") -> HealthFinding:
        text = f"GPU {index}" + (f": {reading}" if reading else "")
        return HealthFinding(health_signature(what, text), True, index)

    def _new(self, finding: HealthFinding) -> bool:
        """Xids always count; a standing condition is told once per cycle."""
        if finding.signature.detail.startswith("Xid"):
            return True
        told = (finding.gpu or 0, finding.signature.detail)
        if told in self._told:
            return False
        self._told.add(told)
        return True

    def close(self) -> None:
        _optional(self._nvml, "nvmlEventSetFree", self._events)


class HealthWatch(NodeService):
    """Polls while the workers run; sleeps between cycles (the pre-round check covers them)."""

    name = "health watch"

    def __init__(
        self,
        config: HealthCheckConfig,
        emit: Emit,
        post: Post,
        load: Callable[[], Any] = load_nvml,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config, self._emit, self._post = config, emit, post
        self._nvml = load() if config.gpu else None
        self._gpus = None
        if self._nvml is not None:
            try:
                self._gpus = GpuReadings(self._nvml, config.gpus, config.nvlink, clock)
            except (self._nvml.NVMLError, LookupError) as exc:  # the pre-round check says why
                log.warning("health watch: GPUs not watched: %s", exc)
        self._links: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cost = _PollCost()

    def on_started(self, rnd: Round, pids: Iterable[int]) -> None:
        if self._gpus is None and not self._config.nic:
            return
        self.begin_cycle()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)
        self._thread.start()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self._halt()
        if self._cost.polls:
            cost = self._cost
            self._emit("health_watch", polls=cost.polls, mean_us=round(cost.total / cost.polls
                       * 1e6, 1), max_us=round(cost.worst * 1e6, 1))  # fmt: skip

    def close(self) -> None:
        self._halt()
        if self._gpus is not None:
            self._gpus.close()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()

    def gpus(self) -> tuple[GpuSnapshot, ...]:
        """What the last poll read of each watched GPU (for the metrics; empty before one)."""
        return self._gpus.latest if self._gpus is not None else ()

    def begin_cycle(self) -> None:
        """Take the cycle's baselines (ECC counts, link_downed) and drop older Xid events."""
        if self._gpus is not None:
            self._gpus.start_cycle()
        self._links = {}
        if self._config.nic:
            self._read_links()
        self._cost = _PollCost()

    def poll(self) -> list[HealthFinding]:
        """One reading of everything watched (public for tests and the bench)."""
        started = time.perf_counter()
        found = self._gpus.read() if self._gpus is not None else []
        if self._config.nic:
            found += self._read_links()
        self._cost.add(time.perf_counter() - started)
        return found

    def _run(self) -> None:
        while not self._stop.wait(self._config.watch_interval):
            try:
                findings = self.poll()
            except Exception as exc:  # NVML itself failing is a finding, not a crash
                findings = [HealthFinding(health_signature("NVML query failed", str(exc)), True)]
            for finding in findings:
                self.tell(finding)

    def tell(self, finding: HealthFinding) -> None:
        """An event and a log line; a fault also goes to the agent."""
        sig = finding.signature
        self._emit("health_finding", finding=sig.detail, reading=sig.message, fault=finding.fault,
                   gpu=finding.gpu)  # fmt: skip
        log.log(logging.ERROR if finding.fault else logging.WARNING, "health: %s (%s)",
                sig.detail, sig.message)  # fmt: skip
        if finding.fault:
            self._post(finding)

    def _read_links(self) -> list[HealthFinding]:
        try:
            check_ib_ports(self._config.nic_sysfs_root, self._links)
        except NodeUnhealthyError as exc:
            return [HealthFinding(health_signature("InfiniBand link went down", str(exc)), True)]
        return []

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._config.watch_interval + 5.0)
            self._thread = None


def _index(nvml: Any, device: Any) -> int:
    try:
        return int(nvml.nvmlDeviceGetIndex(device))
    except Exception:
        return -1


def _optional(nvml: Any, query: str, *args: Any) -> Any:
    """`nvml.<query>(*args)`, or None where this GPU or driver does not support it (any NVML
    error: a poll reads on where `nvml.supported` would raise)."""
    try:
        return getattr(nvml, query)(*args)
    except nvml.NVMLError:
        return None
