"""--numa-binding: the plan (pure, a made-up topology), NVML's view (the fake pynvml), the option
and its errors, and the binding applied in one real short-lived process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ftrun.agent.placement import binding, numa
from ftrun.agent.placement.binding import (
    format_cpulist,
    parse_cpulist,
    prepare_binding,
)
from ftrun.agent.placement.numa import (
    Binding,
    EmptyBindingError,
    GpuAffinity,
    NoTopologyError,
    NumaPlan,
    Topology,
    UnsupportedModeError,
    binding_env,
    plan,
    plan_launch,
)
from ftrun.agent.worker_env import worker_envs
from ftrun.agent.workers import spawn_process
from ftrun.environment import Env
from ftrun.errors import ConfigError, ExitCode
from ftrun.ft_launcher import cli
from ftrun.ft_launcher.build import build_config
from ftrun.rendezvous.ranks import NodeDescriptor, Round

FAKES = Path(__file__).resolve().parent / "fakes"
ALL = frozenset(range(64))


def cpus(text: str) -> frozenset[int]:
    return parse_cpulist(text) if text else frozenset()


# Two sockets of two NUMA nodes of 8 CPUs; two GPUs per NUMA node (GPU i on node i // 2).
NODE_CPUS = ("0-7", "8-15", "16-23", "24-31")
SOCKET_CPUS = ("0-15", "16-31")
TWO_SOCKETS = Topology(
    {
        str(gpu): GpuAffinity(
            node_cpus=cpus(NODE_CPUS[gpu // 2]),
            node_mems=frozenset({gpu // 2}),
            socket_cpus=cpus(SOCKET_CPUS[gpu // 4]),
            socket_mems=frozenset({gpu // 4 * 2, gpu // 4 * 2 + 1}),
        )
        for gpu in range(8)
    }
)
GPUS = [str(gpu) for gpu in range(8)]


def one_node(node_cpus: str, gpus: int, cores: Mapping[int, int] | None = None) -> Topology:
    """`gpus` GPUs on one NUMA node (memory node 0) whose CPUs are `node_cpus`."""
    affinity = GpuAffinity(cpus(node_cpus), frozenset({0}), cpus(node_cpus), frozenset({0}))
    return Topology({str(g): affinity for g in range(gpus)}, MappingProxyType(dict(cores or {})))


def cpu_lists(bindings: list[Binding]) -> list[str]:
    return [format_cpulist(b.cpus) for b in bindings]


# --- cpulists --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "items"),
    [
        ("0", {0}),
        ("0-3", {0, 1, 2, 3}),
        ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
        ("0-1,64-65", {0, 1, 64, 65}),
        ("5-5", {5}),
    ],
)
def test_cpulists_parse_and_format(text: str, items: set[int]) -> None:
    assert parse_cpulist(text) == items
    assert parse_cpulist(f" {text}\n") == items  # as sysfs files end
    assert parse_cpulist(format_cpulist(items)) == items
    assert format_cpulist(parse_cpulist(text)) == text.replace("5-5", "5")


def test_cpulists_round_trip_arbitrary_sets() -> None:
    for items in ({1, 3, 5}, set(range(0, 128, 2)) | {7, 8, 9}, set(range(200))):
        assert parse_cpulist(format_cpulist(items)) == items
    assert format_cpulist([]) == ""
    assert format_cpulist([3, 1, 2, 2]) == "1-3"


@pytest.mark.parametrize("text", ["", "a", "1,,2", "3-1", "1-", "-1", "0x3"])
def test_bad_cpulists_are_value_errors(text: str) -> None:
    with pytest.raises(ValueError, match="not a cpulist"):
        parse_cpulist(text)


# --- the plan (pure) -------------------------------------------------------------------------


def test_node_binds_each_rank_to_its_gpus_numa_node() -> None:
    bindings = plan("node", TWO_SOCKETS, GPUS, ALL)
    assert cpu_lists(bindings) == ["0-7", "0-7", "8-15", "8-15", "16-23", "16-23", "24-31", "24-31"]
    assert [set(b.mems) for b in bindings] == [{0}, {0}, {1}, {1}, {2}, {2}, {3}, {3}]


def test_socket_binds_each_rank_to_its_gpus_socket() -> None:
    bindings = plan("socket", TWO_SOCKETS, GPUS, ALL)
    assert cpu_lists(bindings) == ["0-15"] * 4 + ["16-31"] * 4
    assert [format_cpulist(b.mems) for b in bindings] == ["0-1"] * 4 + ["2-3"] * 4


def test_exclusive_splits_each_node_among_its_ranks() -> None:
    bindings = plan("exclusive", TWO_SOCKETS, GPUS, ALL)
    assert " ".join(cpu_lists(bindings)) == "0-3 4-7 8-11 12-15 16-19 20-23 24-27 28-31"
    assert [set(b.mems) for b in bindings] == [{0}, {0}, {1}, {1}, {2}, {2}, {3}, {3}]


def test_exclusive_two_and_four_gpus_on_one_node() -> None:
    assert cpu_lists(plan("exclusive", one_node("0-15", 2), ["0", "1"], ALL)) == ["0-7", "8-15"]
    four = plan("exclusive", one_node("0-15", 4), ["0", "1", "2", "3"], ALL)
    assert cpu_lists(four) == ["0-3", "4-7", "8-11", "12-15"]


def test_exclusive_uneven_split_gives_the_first_ranks_one_core_more() -> None:
    four = plan("exclusive", one_node("0-9", 4), ["0", "1", "2", "3"], ALL)
    assert cpu_lists(four) == ["0-2", "3-5", "6-7", "8-9"]
    two = plan("exclusive", one_node("0-6", 2), ["0", "1"], ALL)
    assert cpu_lists(two) == ["0-3", "4-6"]


def test_exclusive_keeps_hyperthread_siblings_in_one_share() -> None:
    # CPUs 0-3 and their siblings 8-11 (cores numbered by the lowest sibling)
    topology = one_node("0-3,8-11", 2, cores={8: 0, 9: 1, 10: 2, 11: 3})
    assert cpu_lists(plan("exclusive", topology, ["0", "1"], ALL)) == ["0-1,8-9", "2-3,10-11"]


def test_exclusive_counts_only_the_ranks_on_that_node() -> None:
    # torch would give GPU 1 half of node 0; no other rank uses node 0 here, so it gets all
    assert cpu_lists(plan("exclusive", TWO_SOCKETS, ["1"], ALL)) == ["0-7"]
    mixed = plan("exclusive", TWO_SOCKETS, ["0", "2", "3"], ALL)
    assert cpu_lists(mixed) == ["0-7", "8-11", "12-15"]
    # ranks in local-rank order, whatever their GPUs' order
    assert cpu_lists(plan("exclusive", TWO_SOCKETS, ["1", "0"], ALL)) == ["0-3", "4-7"]


def test_bindings_stay_within_the_allowed_cpus() -> None:
    allowed = cpus("2-5,9,24-31")
    node = plan("node", TWO_SOCKETS, ["0", "2", "6"], allowed)
    assert cpu_lists(node) == ["2-5", "9", "24-31"]
    exclusive = plan("exclusive", TWO_SOCKETS, ["0", "1", "6", "7"], allowed)
    assert cpu_lists(exclusive) == ["2-3", "4-5", "24-27", "28-31"]
    socket = plan("socket", TWO_SOCKETS, ["0", "7"], allowed)
    assert cpu_lists(socket) == ["2-5,9", "24-31"]


def test_a_rank_left_without_cpus_is_a_one_line_error() -> None:
    with pytest.raises(EmptyBindingError) as info:
        plan("node", TWO_SOCKETS, ["0", "2"], cpus("0-7"))
    assert str(info.value) == (
        "local rank 1 (GPU 2) would get no CPU: its node has CPUs 8-15, the launcher may use 0-7"
    )
    with pytest.raises(EmptyBindingError, match=r"1 usable physical core\(s\) for 2 local ranks"):
        plan("exclusive", TWO_SOCKETS, ["0", "1"], cpus("3"))
    with pytest.raises(ConfigError):  # every NUMA error is a usage error: exit 2
        plan("socket", TWO_SOCKETS, ["0"], frozenset())


def test_core_complex_is_refused_naming_exclusive() -> None:
    with pytest.raises(UnsupportedModeError) as info:
        plan("core-complex", TWO_SOCKETS, GPUS, ALL)
    message = str(info.value)
    assert "\n" not in message
    assert "L3" in message
    assert "--numa-binding=exclusive" in message
    assert info.value.exit_code == ExitCode.USAGE


def test_the_plan_becomes_two_variables_per_rank() -> None:
    numa_plan = NumaPlan("node", (Binding(cpus("0-3,8"), frozenset({1})), Binding(cpus("4"))))
    assert binding_env(numa_plan, 0) == {Env.CPU_BIND: "0-3,8", Env.MEM_BIND: "1"}
    # No memory node known: memory is left alone.
    assert binding_env(numa_plan, 1) == {Env.CPU_BIND: "4"}


# --- NVML's view (the fake pynvml) -----------------------------------------------------------

FAKE_SPEC: dict[str, Any] = {
    "devices": 4,
    "cpu_affinity": {
        str(gpu): {"node": NODE_CPUS[gpu // 2], "socket": SOCKET_CPUS[0]} for gpu in range(4)
    },
    "mem_affinity": {str(gpu): {"node": str(gpu // 2), "socket": "0-1"} for gpu in range(3)},
    "uuids": {"GPU-aa": 0, "GPU-cc": 2, "MIG-dd": 3},
}


@pytest.fixture
def fake_nvml(fake_nvml: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The fake NVML (conftest's), FAKE_NVML describing FAKE_SPEC, no sysfs siblings."""
    fake_nvml.setenv("FAKE_NVML", json.dumps(FAKE_SPEC))
    fake_nvml.setattr(numa, "_read_cores", lambda cpus: {})  # this host's hyperthreads
    yield fake_nvml


def launch(mode: str, nproc: int, visible: str | None) -> list[tuple[str, str]]:
    bindings = plan_launch(mode, nproc, visible, ALL).bindings
    return [(format_cpulist(b.cpus), format_cpulist(b.mems)) for b in bindings]


def test_nvml_affinity_by_local_rank(fake_nvml: pytest.MonkeyPatch) -> None:
    assert launch("node", 4, None) == [("0-7", "0"), ("0-7", "0"), ("8-15", "1"), ("8-15", "")]
    assert launch("socket", 1, None) == [("0-15", "0-1")]
    assert launch("exclusive", 2, None) == [("0-3", "0"), ("4-7", "0")]


def test_cuda_visible_devices_indices_and_uuids(fake_nvml: pytest.MonkeyPatch) -> None:
    assert launch("node", 2, "2,0") == [("8-15", "1"), ("0-7", "0")]
    assert launch("node", 2, "GPU-cc, GPU-aa") == [("8-15", "1"), ("0-7", "0")]
    assert launch("node", 1, "MIG-dd") == [("8-15", "")]  # the MIG instance's GPU
    assert launch("exclusive", 2, "0,GPU-cc") == [("0-7", "0"), ("8-15", "1")]


@pytest.mark.parametrize(
    ("nproc", "visible", "message"),
    [
        (3, "0,1", "local rank 2 has no GPU in CUDA_VISIBLE_DEVICES=0,1"),
        (1, "GPU-zz", "GPU GPU-zz: NVML cannot tell its affinity"),
        (5, None, "GPU 4: NVML cannot tell its affinity"),
        (1, "", "CUDA_VISIBLE_DEVICES entry '' names no GPU"),
    ],
)
def test_a_rank_without_a_known_gpu_is_an_error(
    fake_nvml: pytest.MonkeyPatch, nproc: int, visible: str | None, message: str
) -> None:
    with pytest.raises(NoTopologyError, match=message):
        plan_launch("node", nproc, visible, ALL)


def test_without_nvml(fake_nvml: pytest.MonkeyPatch) -> None:
    fake_nvml.delenv("FAKE_NVML")
    with pytest.raises(NoTopologyError, match="NVML is not available"):
        plan_launch("node", 1, None, ALL)
    with pytest.raises(UnsupportedModeError):  # refused before NVML is asked
        plan_launch("core-complex", 1, None, ALL)


def test_nvml_masks_and_sysfs_siblings() -> None:
    assert numa._bits([0b101, 1]) == {0, 2, 64}
    assert numa._read_cores([10**6]) == {}  # no such CPU: its own core
    if os.path.exists("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list"):
        assert numa._read_cores([0]) == {0: 0}


# --- the option, the config and the workers' environment -------------------------------------


def test_the_option_builds_the_plan_once_into_the_config(
    fake_nvml: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_nvml.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    config = build_config(["--numa-binding=exclusive", "--nproc-per-node=2", "x"], {})
    assert config.agent.numa_binding == NumaPlan(
        "exclusive", (Binding(cpus("0-2"), frozenset({0})), Binding(cpus("3-5"), frozenset({0})))
    )
    rnd = Round(0, (NodeDescriptor("n0", "127.0.0.1", 2, 29500),), 0)
    envs = worker_envs(config, {Env.MEM_BIND: "7"}, {}, rnd, "n0", tmp_path)
    assert [(env[Env.CPU_BIND], env[Env.MEM_BIND]) for env in envs] == [("0-2", "0"), ("3-5", "0")]
    unbound = build_config(["--nproc-per-node=2", "x"], {})
    assert unbound.agent.numa_binding is None
    inherited = {Env.CPU_BIND: "1", Env.MEM_BIND: "0"}  # a launcher started by a bound worker
    for env in worker_envs(unbound, inherited, {}, rnd, "n0", tmp_path):
        assert Env.CPU_BIND not in env and Env.MEM_BIND not in env


def config_error(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(argv, {})
    return str(info.value)


def test_config_errors_name_the_option(fake_nvml: pytest.MonkeyPatch) -> None:
    assert config_error("--numa-binding=core-complex", "x") == (
        "--numa-binding=core-complex: not supported: NVML reports no L3 cache domains; use "
        "--numa-binding=exclusive (a disjoint share of the GPU's NUMA node per worker)"
    )
    fake_nvml.delenv("FAKE_NVML")
    assert config_error("--numa_binding=socket", "x") == (
        "--numa-binding=socket: NVML is not available (no NVIDIA driver or no GPU here)"
    )
    assert "--numa-binding" in config_error("--numa-binding=all", "x")


@pytest.mark.parametrize("mode", ["core-complex", "node"])
def test_cli_refuses_in_one_line_with_exit_2(
    fake_nvml: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    fake_nvml.delenv("FAKE_NVML")  # no driver
    with pytest.raises(SystemExit) as info:
        cli.main([f"--numa-binding={mode}", "train.py"])
    assert info.value.code == ExitCode.USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"ft_launcher: error: --numa-binding={mode}: ")
    assert "Traceback" not in err


# --- applying it -----------------------------------------------------------------------------


def test_no_variables_no_binding() -> None:
    assert prepare_binding({}) is None
    assert prepare_binding({Env.CPU_BIND: "", Env.MEM_BIND: ""}) is None
    with pytest.raises(ValueError, match="not a cpulist"):
        prepare_binding({Env.CPU_BIND: "0-x"})


def test_refused_bindings_are_one_line_each(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failing calls change nothing, so they can run in this process."""
    apply = prepare_binding({Env.CPU_BIND: "1000000", Env.MEM_BIND: "63"})  # no such CPU, node
    assert apply is not None
    before = os.sched_getaffinity(0)
    apply()
    assert os.sched_getaffinity(0) == before
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("ftrun: CPU binding to 1000000 not applied: ")
    assert lines[1].startswith("ftrun: memory binding to node(s) 63 not applied (")
    assert lines[1].endswith("); CPU binding kept")
    monkeypatch.setattr(binding, "_SYS_SET_MEMPOLICY", {})
    prepare_binding({Env.MEM_BIND: "0"})()  # type: ignore[misc]
    assert capfd.readouterr().err.startswith("ftrun: memory binding to node(s) 0 skipped: ")


CHILD = """
import os, sys
from ftrun.agent.placement.binding import apply_binding
before = sorted(os.sched_getaffinity(0))
apply_binding({"FTRUN_CPU_BIND": sys.argv[1], "FTRUN_MEM_BIND": "63"})
print(before, sorted(os.sched_getaffinity(0)))
"""


def test_a_spawned_worker_is_bound_before_exec_and_apply_binding_rebinds_it() -> None:
    """The one process: spawn_process binds it (FTRUN_CPU_BIND in its env), then the script
    calls apply_binding to move to another CPU; its memory node does not exist (tolerated)."""
    allowed = sorted(os.sched_getaffinity(0))
    first, last = allowed[0], allowed[-1]
    env = {**os.environ, Env.CPU_BIND: str(first)}
    env.pop(Env.MEM_BIND, None)
    proc = spawn_process([sys.executable, "-c", CHILD, str(last)], env, subprocess.DEVNULL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.decode().split("\n") == [f"[{first}] [{last}]", ""]
    lines = err.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ftrun: memory binding to node(s) 63 not applied (")
