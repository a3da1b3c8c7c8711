"""The health watch's NVLink check (NVRx 0.7's NVLinkWindowHealthCheck): the window rule alone,
then the watch against the fake NVML (tests/fakes/pynvml.py) with an injected clock."""

from __future__ import annotations

import json

import pytest

from ftrun.agent.node_services.health_watch import HealthFinding, HealthWatch
from ftrun.agent.node_services.nvlink_window import LinkWindows
from ftrun.config.agent import HealthCheckConfig

MINUTE = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0 * MINUTE

    def __call__(self) -> float:
        return self.now


def nvlink_watch(fake_nvml: pytest.MonkeyPatch, spec: dict, clock: Clock) -> HealthWatch:
    fake_nvml.setenv("FAKE_NVML", json.dumps(spec))
    config = HealthCheckConfig(nvlink=True, watch_interval=5)
    service = HealthWatch(config, lambda kind, **f: None, lambda f: None, clock=clock)
    service.begin_cycle()  # the test polls by hand: no thread
    return service


def errors(found: list[HealthFinding]) -> list[tuple[str, str, int | None]]:
    return [(f.signature.detail, f.signature.message, f.gpu) for f in found if f.fault]


def rising(fake_nvml, spec: dict, service: HealthWatch, clock: Clock, minutes: list[int]) -> list:
    """Poll every 20 s for 40 minutes, link 1 of GPU 0 gaining errors in the given minutes;
    returns the minutes at which a poll found something, and what."""
    found, count = [], 0
    for step in range(40 * 3):
        if step // 3 in minutes:
            count += 7
        spec["nvlink_errors"] = {"0": {"0": 5, "1": count}}
        fake_nvml.setenv("FAKE_NVML", json.dumps(spec))
        found += [(step // 3, f) for f in errors(service.poll())]
        clock.now += 20
    return found


def test_a_window_is_flagged_once_however_often_it_is_read() -> None:
    windows = LinkWindows()
    assert windows.add(0.0, (0, 1), {215: 4}) == 0  # the first reading: the baseline
    assert windows.add(5.0, (0, 1), {215: 9}) == 1
    assert windows.add(10.0, (0, 1), {215: 20, 208: 3}) == 1  # same window; 208 is new: no delta
    assert windows.add(65.0, (0, 1), {215: 2}) == 1  # a reset is a new baseline, not errors
    assert windows.add(70.0, (0, 1), {208: 4}) == 2
    assert windows.add(30 * MINUTE, (0, 1), {208: 4}) == 1  # windows 1..30: the first left
    assert not windows.bad(15) and windows.bad(16)


@pytest.mark.parametrize(
    "spec", [{"devices": 1, "nvlinks": 0}, {"devices": 1, "nvlinks": 0, "nvlink_legacy": True}]
)
def test_no_nvlink_nothing_read_nothing_found(fake_nvml, spec: dict) -> None:
    """A single GPU, or NVML answering NOT_SUPPORTED for every link."""
    clock = Clock()
    service = nvlink_watch(fake_nvml, spec, clock)
    assert rising(fake_nvml, spec, service, clock, list(range(40))) == []
    service.close()


def test_steady_counters_are_healthy(fake_nvml) -> None:
    clock, spec = Clock(), {"devices": 2, "nvlink_errors": {"0": {"0": 40, "1": 7}}}
    service = nvlink_watch(fake_nvml, spec, clock)
    for _ in range(100):
        assert service.poll() == []
        clock.now += MINUTE
    service.close()


@pytest.mark.parametrize("legacy", [False, True])
def test_errors_in_more_than_15_of_30_minutes_are_a_fault(fake_nvml, legacy: bool) -> None:
    clock, spec = Clock(), {"devices": 2, "nvlink_legacy": legacy}
    service = nvlink_watch(fake_nvml, spec, clock)
    found = rising(fake_nvml, spec, service, clock, list(range(10, 30)))
    # The 16th minute with errors (minute 25) trips it; told once in the cycle.
    assert found == [(25, ("NVLink errors", "GPU 0: link 1: 16 of 30 windows", 0))]
    service.close()


def test_errors_spread_wider_than_the_window_are_not(fake_nvml) -> None:
    clock, spec = Clock(), {"devices": 1}
    service = nvlink_watch(fake_nvml, spec, clock)
    # 20 minutes with errors, every other minute: at most 15 in any 30 minutes.
    assert rising(fake_nvml, spec, service, clock, list(range(1, 40, 2))) == []
    service.close()


def test_one_burst_is_one_window(fake_nvml) -> None:
    clock, spec = Clock(), {"devices": 1, "nvlink_errors": {"0": {"1": 0}}}
    service = nvlink_watch(fake_nvml, spec, clock)
    service.poll()
    fake_nvml.setenv("FAKE_NVML", json.dumps({**spec, "nvlink_errors": {"0": {"1": 10**6}}}))
    for _ in range(60):
        assert service.poll() == []
        clock.now += 5
    service.close()


def test_a_link_going_down_is_a_fault_told_once_per_cycle(fake_nvml) -> None:
    clock, spec = Clock(), {"devices": 2}
    service = nvlink_watch(fake_nvml, spec, clock)
    assert service.poll() == []
    fake_nvml.setenv("FAKE_NVML", json.dumps({**spec, "faults": {"1": ["nvlink"]}}))
    assert errors(service.poll()) == [("NVLink down", "GPU 1: link 0, 1", 1)]
    assert service.poll() == []
    service.begin_cycle()
    assert errors(service.poll()) == [("NVLink down", "GPU 1: link 0, 1", 1)]
    service.close()
