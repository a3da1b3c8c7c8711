"""The InfiniBand NIC health check: unit tests on a fake sysfs tree, and one two-node job."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ftrun.agent.node_services.health import check_node
from ftrun.config.agent import HealthCheckConfig
from ftrun.errors import ConfigError, NodeUnhealthyError
from ftrun.ft_launcher.build import build_config
from ftrun.infiniband import check_ib_ports
from launch import ROOT, start_job

LIGHT = ROOT / "tests" / "workers" / "fault_worker.py"
UP = {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "counters/link_downed": "0"}


def fake_sysfs(root: Path, ports: dict[str, dict[str, str]]) -> Path:
    """A /sys/class/infiniband look-alike: {"mlx5_0/1": {file: content, ...}, ...}."""
    for name, files in ports.items():
        device, port = name.split("/")
        for rel, content in files.items():
            path = root / device / "ports" / port / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content + "\n")
    return root


def write(root: Path, port: str, rel: str, content: str) -> None:
    device, number = port.split("/")
    (root / device / "ports" / number / rel).write_text(content + "\n")


def test_active_ports_pass_and_are_counted(tmp_path: Path):
    root = fake_sysfs(tmp_path, {"mlx5_0/1": UP, "mlx5_1/1": UP, "mlx5_1/2": UP})
    assert check_ib_ports(str(root), {}) == {"ib_ports": 3}
    bare = {**UP, "state": "ACTIVE", "phys_state": "LinkUp"}  # no "N: " prefix
    assert check_ib_ports(str(fake_sysfs(tmp_path / "b", {"ib0/1": bare})), {}) == {"ib_ports": 1}


@pytest.mark.parametrize(
    ("rel", "content", "reason"),
    [
        ("state", "1: DOWN", "InfiniBand mlx5_1 port 1: state DOWN (not ACTIVE)"),
        ("state", "2: INIT", "InfiniBand mlx5_1 port 1: state INIT (not ACTIVE)"),
        (
            "phys_state",
            "2: Polling",
            "InfiniBand mlx5_1 port 1: physical state Polling (not LinkUp)",
        ),
    ],
)
def test_a_port_not_up_makes_the_node_unhealthy(
    tmp_path: Path, rel: str, content: str, reason: str
):
    root = fake_sysfs(tmp_path, {"mlx5_0/1": UP, "mlx5_1/1": {**UP, rel: content}})
    with pytest.raises(NodeUnhealthyError) as info:
        check_ib_ports(str(root), {})
    assert str(info.value) == reason


def test_every_bad_port_is_named_on_one_line(tmp_path: Path):
    down = {**UP, "state": "1: DOWN", "phys_state": "3: Disabled"}
    root = fake_sysfs(
        tmp_path, {"mlx5_0/1": down, "mlx5_2/1": UP, "mlx5_10/1": {**UP, "state": "1: DOWN"}}
    )
    with pytest.raises(NodeUnhealthyError) as info:
        check_ib_ports(str(root), {})
    assert str(info.value) == (
        "InfiniBand mlx5_0 port 1: state DOWN (not ACTIVE), physical state Disabled (not LinkUp); "
        "mlx5_10 port 1: state DOWN (not ACTIVE)"
    )


def test_a_link_downed_increase_between_checks_is_a_flap(tmp_path: Path):
    root = fake_sysfs(tmp_path, {"mlx5_0/1": {**UP, "counters/link_downed": "7"}, "mlx5_1/1": UP})
    baseline: dict[str, int] = {}
    assert check_ib_ports(str(root), baseline) == {"ib_ports": 2}  # records 7 and 0
    assert check_ib_ports(str(root), baseline) == {"ib_ports": 2}  # unchanged: fine
    write(root, "mlx5_1/1", "counters/link_downed", "1")
    flapped = "InfiniBand mlx5_1 port 1: link_downed 0 -> 1 since the last check (the link flapped)"
    with pytest.raises(NodeUnhealthyError, match=f"^{re.escape(flapped)}$"):
        check_ib_ports(str(root), baseline)
    with pytest.raises(NodeUnhealthyError, match=f"^{re.escape(flapped)}$"):  # it stays suspect
        check_ib_ports(str(root), baseline)
    # A fresh agent (a new baseline) takes the counter as it finds it.
    assert check_ib_ports(str(root), {}) == {"ib_ports": 2}


def test_a_counter_that_went_down_is_a_new_baseline(tmp_path: Path):
    """A driver reload resets the counters: not a flap, and later increases count from there."""
    root = fake_sysfs(tmp_path, {"mlx5_0/1": {**UP, "counters/link_downed": "5"}})
    baseline: dict[str, int] = {}
    check_ib_ports(str(root), baseline)
    write(root, "mlx5_0/1", "counters/link_downed", "0")
    assert check_ib_ports(str(root), baseline) == {"ib_ports": 1}
    write(root, "mlx5_0/1", "counters/link_downed", "2")
    with pytest.raises(NodeUnhealthyError, match="link_downed 0 -> 2"):
        check_ib_ports(str(root), baseline)


def test_unreadable_files_make_the_node_unhealthy_naming_the_path(tmp_path: Path):
    root = fake_sysfs(tmp_path, {"mlx5_0/1": UP})
    port = root / "mlx5_0" / "ports" / "1"
    (port / "phys_state").unlink()
    with pytest.raises(NodeUnhealthyError) as info:
        check_ib_ports(str(root), {})
    assert str(info.value) == (
        f"InfiniBand mlx5_0 port 1: cannot read {port / 'phys_state'}: No such file or directory"
    )
    write(root, "mlx5_0/1", "phys_state", "5: LinkUp")
    write(root, "mlx5_0/1", "counters/link_downed", "n/a")
    with pytest.raises(
        NodeUnhealthyError, match=rf"cannot parse {port}/counters/link_downed: 'n/a'"
    ):
        check_ib_ports(str(root), {})
    (root / "mlx5_1").mkdir()  # a device without ports/
    with pytest.raises(NodeUnhealthyError, match=rf"mlx5_1: cannot list {root}/mlx5_1/ports"):
        check_ib_ports(str(root), {})
    assert "\n" not in str(info.value)


def test_no_devices_passes_and_says_so(tmp_path: Path):
    assert check_ib_ports(str(tmp_path / "absent"), {}) == {"ib_ports": 0}
    assert check_ib_ports(str(tmp_path), {}) == {"ib_ports": 0}


def test_check_node_runs_the_nic_check_only_when_enabled(tmp_path: Path):
    root = fake_sysfs(tmp_path, {"mlx5_0/1": UP, "mlx5_1/1": {**UP, "state": "1: DOWN"}})
    assert "ib_ports" not in check_node(HealthCheckConfig(gpu=False, nic_sysfs_root=str(root)))
    with pytest.raises(NodeUnhealthyError, match="mlx5_1 port 1: state DOWN"):
        check_node(HealthCheckConfig(gpu=False, nic=True, nic_sysfs_root=str(root)))
    write(root, "mlx5_1/1", "state", "4: ACTIVE")
    config = HealthCheckConfig(gpu=False, nic=True, nic_sysfs_root=str(root))
    assert check_node(config) == {"ib_ports": 2, "storage_paths": 0}


def test_options_build_the_nic_config():
    config = build_config(["--ft-enable-nic-healthcheck", "--ft-nic-sysfs-root=/x", "s"], {})
    assert (config.health.nic, config.health.nic_sysfs_root) == (True, "/x")
    assert build_config(["s"], {}).health.nic is False
    assert build_config(["--ft-nic-sysfs-root=/x", "s"], {}).warnings == (
        "--ft-nic-sysfs-root is ignored: the NIC health check is off",
    )
    with pytest.raises(ConfigError, match=r"^--ft-nic-sysfs-root: must not be empty$"):
        build_config(["--ft-enable-nic-healthcheck", "--ft-nic-sysfs-root=", "s"], {})


@pytest.mark.process
def test_a_node_with_a_port_down_exits_unhealthy_and_the_other_is_told(tmp_path: Path):
    good = fake_sysfs(tmp_path / "ib-good", {"mlx5_0/1": UP, "mlx5_1/1": UP})
    bad = fake_sysfs(tmp_path / "ib-bad", {"mlx5_0/1": UP, "mlx5_1/1": {**UP, "state": "1: DOWN"}})
    args = [
        "--ft-no-gpu-health-check",
        "--ft-enable-nic-healthcheck",
        f"--ft-nic-sysfs-root={good}",
    ]
    # No worker ever starts: the light script (no torch) spares each fork server its imports.
    job = start_job(tmp_path, 2, args, order=[0], script=LIGHT)
    # launch.py gives every node the same argv: the second node reads the broken tree.
    job.argv = [arg.replace(str(good), str(bad)) for arg in job.argv]
    job.add_node(1)
    assert job.wait(60) == [1, 3]
    assert "at most 1 healthy node(s) can join, 2 needed" in job.nodes[0].text()
    reason = "node unhealthy: InfiniBand mlx5_1 port 1: state DOWN (not ACTIVE)"
    assert reason in job.nodes[1].text()
    sick = job.events("unhealthy")
    assert len(sick) == 1 and "mlx5_1 port 1: state DOWN" in sick[0]["reason"]
    assert [e["ib_ports"] for e in job.events("health_check")] == [2]
    assert not job.events("workers_started")
