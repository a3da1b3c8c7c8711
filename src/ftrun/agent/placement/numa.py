"""`--numa-binding`: which CPUs and memory nodes each local worker is bound to (the decision).

torch 2.13's `torch.numa.binding.AffinityMode` semantics, from NVML's report of each GPU's
affinity (torch walks sysfs from the GPU's PCI address instead):

- node: the CPUs and memory of the GPU's NUMA node;
- socket: the CPUs and memory of the GPU's socket (all of its NUMA nodes);
- exclusive: the GPU's NUMA node's CPUs split into disjoint, contiguous, equal shares of whole
  physical cores (the lower local ranks get one core more when the split is uneven), one per
  local rank whose GPU sits on that node; memory: that node. torch splits among every GPU of
  the node; here only the GPUs this launcher's workers use count, so fewer workers get more.
- core-complex: one L3 domain per worker in torch; NVML reports no caches, so it is refused.

Every binding is intersected with the CPUs the launcher itself may use (its cgroup, Slurm's
--cpu-bind): a worker is never given a CPU the launcher was not.

The GPU of local rank N is entry N of the launcher's CUDA_VISIBLE_DEVICES (an index or a
`GPU-`/`MIG-` UUID), else GPU N: the GPU `torch.device("cuda", LOCAL_RANK)` is, also under
--virtual-local-rank (`rank_env.visible_device`). Indices are NVML's, which are CUDA's under
CUDA_DEVICE_ORDER=PCI_BUS_ID and on nodes with identical GPUs.

`read_topology` is the one function that reads NVML (and sysfs, for hyperthread siblings);
`plan` is pure; `plan_launch` joins them, once per launch (`ftrun.ft_launcher.build`). The
worker applies its binding itself (`ftrun.agent.placement.binding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ftrun.agent.placement.binding import format_cpulist, parse_cpulist
from ftrun.agent.placement.rank_env import visible_device
from ftrun.config.agent import Binding, NumaPlan
from ftrun.environment import Env
from ftrun.errors import ConfigError
from ftrun.nvml import handle_of, nvml_session

MODES = ("node", "socket", "exclusive")
"""The modes ftrun computes (torchrun's fourth, core-complex, is refused: `REFUSED`)."""
REFUSED = {
    "core-complex": "NVML reports no L3 cache domains; use --numa-binding=exclusive "
    "(a disjoint share of the GPU's NUMA node per worker)",
}
_SCOPE_NODE, _SCOPE_SOCKET = 0, 1
"""NVML_AFFINITY_SCOPE_NODE / _SOCKET (nvml.h), should an old pynvml lack the names."""
_WORD_BITS = 64
"""NVML's affinity masks are arrays of C unsigned long: 64 bits on 64-bit Linux."""


class NumaError(ConfigError):
    """`--numa-binding` cannot be honoured on this node (a usage error: exit 2, one line)."""


class NoTopologyError(NumaError):
    """No NVML, or no such GPU: nothing to take the affinity from."""


class UnsupportedModeError(NumaError):
    """A torchrun mode that NVML gives no data for (core-complex)."""


class EmptyBindingError(NumaError):
    """A worker would be left without a CPU (its share lies outside the allowed CPUs)."""


@dataclasses.dataclass(frozen=True)
class GpuAffinity:
    """One GPU's CPUs and memory nodes, at NUMA-node and at socket scope (NVML's view)."""

    node_cpus: frozenset[int]
    node_mems: frozenset[int]
    socket_cpus: frozenset[int]
    socket_mems: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Topology:
    """What the plan needs to know of the node."""

    gpus: Mapping[str, GpuAffinity]
    """By the GPU's name as the launcher's CUDA_VISIBLE_DEVICES gives it (index or UUID)."""
    cores: Mapping[int, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """Logical CPU -> its physical core (its lowest hyperthread sibling); missing: its own."""


def binding_env(plan: NumaPlan, local_rank: int) -> dict[str, str]:
    """The worker's FTRUN_CPU_BIND / FTRUN_MEM_BIND (`placement.binding` reads them)."""
    binding = plan.bindings[local_rank]
    env = {Env.CPU_BIND: format_cpulist(binding.cpus)}
    if binding.mems:
        env[Env.MEM_BIND] = format_cpulist(binding.mems)
    return env


def refuse_unsupported(mode: str) -> None:
    """`UnsupportedModeError` for a mode ftrun does not compute (before NVML is touched)."""
    if mode in REFUSED:
        raise UnsupportedModeError(f"not supported: {REFUSED[mode]}")
    if mode not in MODES:
        raise UnsupportedModeError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")


def gpus_of_local_ranks(nproc: int, visible_devices: str | None) -> list[str]:
    """The GPU of each local rank, as CUDA_VISIBLE_DEVICES names it (see the module doc)."""
    try:
        return [visible_device(rank, visible_devices) for rank in range(nproc)]
    except ValueError as err:
        raise NoTopologyError(str(err)) from None


def plan_launch(
    mode: str, nproc: int, visible_devices: str | None, allowed_cpus: Iterable[int] | None = None
) -> NumaPlan:
    """The launch's plan, read from NVML; `allowed_cpus` defaults to this process's."""
    refuse_unsupported(mode)
    gpus = gpus_of_local_ranks(nproc, visible_devices)
    allowed = os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus
    return NumaPlan(mode, tuple(plan(mode, read_topology(gpus), gpus, frozenset(allowed))))


# --- the decision ------------------------------------------------------------------------------


def plan(
    mode: str, topology: Topology, gpu_of_local_rank: Sequence[str], allowed_cpus: frozenset[int]
) -> list[Binding]:
    """Each local rank's binding (index = local rank); a `NumaError` if one cannot be made."""
    refuse_unsupported(mode)
    missing = [gpu for gpu in gpu_of_local_rank if gpu not in topology.gpus]
    if missing:
        raise NoTopologyError(f"no affinity known for GPU {missing[0]}")
    if mode == "exclusive":
        bindings = _exclusive(topology, gpu_of_local_rank, allowed_cpus)
    else:
        bindings = [_whole(topology.gpus[gpu], mode, allowed_cpus) for gpu in gpu_of_local_rank]
    for rank, (gpu, binding) in enumerate(zip(gpu_of_local_rank, bindings, strict=True)):
        if not binding.cpus:
            affinity = topology.gpus[gpu]
            theirs = affinity.socket_cpus if mode == "socket" else affinity.node_cpus
            raise EmptyBindingError(
                f"local rank {rank} (GPU {gpu}) would get no CPU: its {mode} has CPUs "
                f"{format_cpulist(theirs) or 'none'}, the launcher may use "
                f"{format_cpulist(allowed_cpus) or 'none'}"
            )
    return bindings


def _whole(affinity: GpuAffinity, mode: str, allowed: frozenset[int]) -> Binding:
    """Mode node or socket: every allowed CPU and memory node at that scope."""
    if mode == "node":
        return Binding(affinity.node_cpus & allowed, affinity.node_mems)
    return Binding(affinity.socket_cpus & allowed, affinity.socket_mems)


def _exclusive(
    topology: Topology, gpu_of_local_rank: Sequence[str], allowed: frozenset[int]
) -> list[Binding]:
    """Split each NUMA node's allowed physical cores among the local ranks on that node."""
    by_node: dict[frozenset[int], list[int]] = {}
    for rank, gpu in enumerate(gpu_of_local_rank):
        by_node.setdefault(_node_key(topology.gpus[gpu]), []).append(rank)
    bindings: list[Binding] = [Binding(frozenset())] * len(gpu_of_local_rank)
    for ranks in by_node.values():
        affinity = topology.gpus[gpu_of_local_rank[ranks[0]]]
        cores = _physical_cores(affinity.node_cpus & allowed, topology.cores)
        if len(cores) < len(ranks):
            raise EmptyBindingError(
                f"exclusive: the NUMA node of GPU(s) "
                f"{', '.join(gpu_of_local_rank[r] for r in ranks)} has {len(cores)} usable "
                f"physical core(s) for {len(ranks)} local ranks; use --numa-binding=node"
            )
        for share, rank in enumerate(ranks):
            cpus = _share(cores, share, len(ranks))
            bindings[rank] = Binding(frozenset(cpus), affinity.node_mems)
    return bindings


def _node_key(affinity: GpuAffinity) -> frozenset[int]:
    """What identifies the GPU's NUMA node: its memory nodes, else (none reported) its CPUs."""
    return affinity.node_mems or affinity.node_cpus


def _physical_cores(cpus: frozenset[int], cores: Mapping[int, int]) -> list[list[int]]:
    """`cpus` grouped by physical core, in core order: hyperthread siblings stay together, so
    no two shares run on one core."""
    grouped: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        grouped.setdefault(cores.get(cpu, cpu), []).append(cpu)
    return [grouped[core] for core in sorted(grouped)]


def _share(cores: Sequence[Sequence[int]], index: int, count: int) -> list[int]:
    """Share `index` of `count` contiguous, equal shares of `cores` (the first ones one core
    bigger when `count` does not divide them: torch's split)."""
    size, extra = divmod(len(cores), count)
    start = index * size + min(index, extra)
    end = start + size + (1 if index < extra else 0)
    return [cpu for core in cores[start:end] for cpu in core]


# --- reading the node --------------------------------------------------------------------------


def read_topology(gpus: Iterable[str]) -> Topology:
    """NVML's affinity of each named GPU, and the hyperthread siblings of their CPUs (sysfs);
    `NoTopologyError` without NVML or for a GPU it does not know."""
    names = list(dict.fromkeys(gpus))
    with nvml_session() as nvml:
        if nvml is None:
            raise NoTopologyError("NVML is not available (no NVIDIA driver or no GPU here)")
        words = (os.cpu_count() or 1) // _WORD_BITS + 1  # one spare word: ids can have gaps
        affinities = {name: _read_gpu(nvml, name, words) for name in names}
    cpus = frozenset().union(*(a.node_cpus | a.socket_cpus for a in affinities.values()))
    return Topology(MappingProxyType(affinities), MappingProxyType(_read_cores(cpus)))


def _read_gpu(nvml: Any, name: str, words: int) -> GpuAffinity:
    node = getattr(nvml, "NVML_AFFINITY_SCOPE_NODE", _SCOPE_NODE)
    socket = getattr(nvml, "NVML_AFFINITY_SCOPE_SOCKET", _SCOPE_SOCKET)
    try:
        handle = handle_of(nvml, name)
        return GpuAffinity(
            node_cpus=_bits(nvml.nvmlDeviceGetCpuAffinityWithinScope(handle, words, node)),
            node_mems=_memory(nvml, handle, words, node),
            socket_cpus=_bits(nvml.nvmlDeviceGetCpuAffinityWithinScope(handle, words, socket)),
            socket_mems=_memory(nvml, handle, words, socket),
        )
    except nvml.NVMLError as err:
        raise NoTopologyError(f"GPU {name}: NVML cannot tell its affinity: {err}") from None
    except LookupError as err:
        raise NoTopologyError(str(err)) from None


def _memory(nvml: Any, handle: Any, words: int, scope: int) -> frozenset[int]:
    """The GPU's memory nodes at `scope`; none where NVML cannot say (memory left alone)."""
    try:
        return _bits(nvml.nvmlDeviceGetMemoryAffinity(handle, words, scope))
    except nvml.NVMLError_NotSupported:
        return frozenset()


def _bits(words: Iterable[int]) -> frozenset[int]:
    """NVML's bitmask (word i, bit b: item 64*i + b) as the set of items."""
    return frozenset(i * _WORD_BITS + bit for i, word in enumerate(words)
                     for bit in range(_WORD_BITS) if int(word) >> bit & 1)  # fmt: skip


def _read_cores(cpus: Iterable[int]) -> dict[int, int]:
    """CPU -> its lowest hyperthread sibling, from sysfs (NVML does not say); a CPU whose
    file cannot be read is left out (its own core)."""
    cores = {}
    for cpu in cpus:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as siblings:
            cores[cpu] = min(parse_cpulist(siblings.read()))
    return cores
