"""The health watch's readings, in this process, against the fake NVML (tests/fakes/pynvml.py)
and a fake InfiniBand tree: what is a fault, what is only told, and what is told once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftrun.agent.node_services.health_watch import HealthWatch
from ftrun.config.agent import HealthCheckConfig

FAKES = Path(__file__).parent / "fakes"


def watch(config: HealthCheckConfig, told: list, posted: list) -> HealthWatch:
    service = HealthWatch(config, lambda kind, **f: told.append((kind, f)), posted.append)
    return service


def start(service: HealthWatch) -> None:
    service.begin_cycle()  # the test polls by hand: no thread


def test_an_xid_is_a_fault_an_application_xid_is_not(fake_nvml, tmp_path: Path) -> None:
    xids = tmp_path / "xids"
    fake_nvml.setenv("FAKE_NVML", json.dumps({"devices": 2, "xid_file": str(xids)}))
    xids.write_text("1 13\n")  # before the cycle: the pre-round check's business
    service = watch(HealthCheckConfig(watch_interval=1), [], [])
    start(service)
    assert service.poll() == []
    with xids.open("a") as f:
        f.write("1 79\n0 31\n")
    found = service.poll()
    assert [(f.signature.detail, f.fault, f.gpu) for f in found] == [
        ("Xid 79", True, 1),
        ("Xid 31", False, 0),
    ]
    service.close()


def test_throttling_is_told_once_per_cycle_and_is_no_fault(fake_nvml) -> None:
    fake_nvml.setenv("FAKE_NVML", json.dumps({"devices": 1, "throttle": {"0": 0x40 | 0x80}}))
    service = watch(HealthCheckConfig(watch_interval=1), [], [])
    start(service)
    first = service.poll()
    assert sorted(f.signature.detail for f in first) == [
        "hardware power brake slowdown",
        "hardware thermal slowdown",
    ]
    assert not any(f.fault for f in first)
    assert service.poll() == []
    start(service)  # a new cycle tells it again
    assert len(service.poll()) == 2
    service.close()


def test_a_standing_fault_is_told_once_and_posted(fake_nvml) -> None:
    spec = {"devices": 1, "faults": {"0": ["retired_pages"]}}
    fake_nvml.setenv("FAKE_NVML", json.dumps(spec))
    told, posted = [], []
    service = watch(HealthCheckConfig(watch_interval=1), told, posted)
    start(service)
    for finding in service.poll():
        service.tell(finding)
    assert service.poll() == []
    assert [p.signature.detail for p in posted] == ["retired pages pending"]
    assert told == [
        ("health_finding", {"finding": "retired pages pending", "reading": "GPU 0",
                            "fault": True, "gpu": 0}),
    ]  # fmt: skip
    service.close()


def test_a_link_that_went_down_while_training_is_a_fault(tmp_path: Path) -> None:
    port = tmp_path / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "counters" / "link_downed").write_text("0\n")
    config = HealthCheckConfig(gpu=False, nic=True, nic_sysfs_root=str(tmp_path), watch_interval=1)
    service = watch(config, [], [])
    start(service)
    assert service.poll() == []
    (port / "counters" / "link_downed").write_text("1\n")
    [found] = service.poll()
    assert found.fault and found.signature.detail == "InfiniBand link went down"
    assert "link_downed 0 -> 1" in found.signature.message
    service.close()


def test_the_watch_reports_its_own_cost(fake_nvml) -> None:
    fake_nvml.setenv("FAKE_NVML", json.dumps({"devices": 2}))
    told: list = []
    service = watch(HealthCheckConfig(watch_interval=1), told, [])
    start(service)
    for _ in range(3):
        service.poll()
    service.on_stopped(None, [])
    [(kind, fields)] = told
    assert kind == "health_watch" and fields["polls"] == 3 and fields["mean_us"] > 0
    service.close()


def test_an_event_wait_that_fails_otherwise_than_empty_is_a_fault(fake_nvml) -> None:
    fake_nvml.setenv("FAKE_NVML", json.dumps({"devices": 1}))
    service = watch(HealthCheckConfig(watch_interval=1), [], [])
    start(service)
    fake_nvml.setenv("FAKE_NVML", json.dumps({"devices": 1, "event_error": 15}))
    [found] = service.poll()
    assert found.fault and found.signature.detail == "NVML event wait failed"
    service.close()


# ---- two launchers on one host: each answers for its own GPUs --------------------------------


def test_a_launcher_watches_only_the_gpus_its_workers_use(fake_nvml, tmp_path: Path) -> None:
    xids = tmp_path / "xids"
    spec = {"devices": 4, "xid_file": str(xids), "faults": {"1": ["ecc"]}}
    fake_nvml.setenv("FAKE_NVML", json.dumps(spec))
    service = watch(HealthCheckConfig(watch_interval=1, gpus="2,3"), [], [])
    start(service)
    xids.write_text("0 79\n3 48\n")  # GPU 0 is the other launcher's
    found = service.poll()
    assert [(f.signature.detail, f.gpu) for f in found] == [("Xid 48", 3)]  # not GPU 1's ECC
    service.close()


def test_the_pre_round_check_looks_at_the_launchers_gpus_only(fake_nvml) -> None:
    from ftrun.agent.node_services.health import check_node
    from ftrun.errors import NodeUnhealthyError

    spec = {"devices": 4, "faults": {"0": ["retired_pages"]}, "uuids": {"GPU-b": 3}}
    fake_nvml.setenv("FAKE_NVML", json.dumps(spec))
    assert check_node(HealthCheckConfig(gpus="2,GPU-b"))["gpus"] == 2
    with pytest.raises(NodeUnhealthyError, match="GPU 0: retired pages pending"):
        check_node(HealthCheckConfig(gpus="1,0"))
    with pytest.raises(NodeUnhealthyError, match="GPU 0"):
        check_node(HealthCheckConfig())  # unset: every GPU on the host


@pytest.mark.parametrize(
    ("visible", "indices"),
    [("2,1", [2, 1]), ("", []), ("-1", []), ("1,x,0", [1]), ("MIG-a,MIG-b,GPU-c", [1, 0])],
)
def test_cuda_visible_devices_names_the_gpus_as_cuda_reads_it(fake_nvml, visible, indices):
    from ftrun.nvml import load_nvml, visible_gpus

    spec = {"devices": 3, "uuids": {"MIG-a": 1, "MIG-b": 1, "GPU-c": 0}}
    fake_nvml.setenv("FAKE_NVML", json.dumps(spec))
    assert [index for index, _ in visible_gpus(load_nvml(), visible)] == indices
