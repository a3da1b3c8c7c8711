"""Building the configured rendezvous implementation, and the interface the agent uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch.distributed import Store

from ftrun.config.rendezvous import RendezvousConfig, RendezvousImpl
from ftrun.rendezvous.barrier import BarrierRendezvousHandler, Probe
from ftrun.rendezvous.control import JobControl
from ftrun.rendezvous.dynamic import DynamicRendezvous
from ftrun.rendezvous.ranks import NodeDescriptor, Round


class NodeRendezvous(Protocol):
    """What the agent needs from a rendezvous implementation beyond torch's handler API."""

    control: JobControl

    def join(self, interrupted: Callable[[], bool]) -> Round: ...

    def num_nodes_waiting(self, cycle: int | None = None) -> int: ...

    def restore(self) -> None:
        """Write back what this node knows of the rounds into a store that restarted empty."""


def create_rendezvous(
    config: RendezvousConfig,
    store: Store,
    descriptor: Callable[[], NodeDescriptor],
    probe: Probe | None = None,
    on_standby: Callable[[int, tuple[str, ...]], None] | None = None,
) -> NodeRendezvous:
    """`probe` and `on_standby`: hot spares, which only the barrier rendezvous has."""
    if config.impl is RendezvousImpl.BARRIER:
        return BarrierRendezvousHandler(config, store, descriptor, probe, on_standby)
    return DynamicRendezvous(config, store, descriptor)
