"""The barrier rendezvous in torch's handler registry, through the `torchrun.handlers` entry point.

torch loads the entry point when `torch.distributed.elastic.rendezvous` is imported, so
`torch.distributed.elastic` users (and torchrun) can name `ftrun-barrier` as a rendezvous
backend without importing ftrun; ft_launcher itself builds its handlers directly
(`factory.create_rendezvous`). Nothing here imports torch at module level: torch calls
`handler_factory` while its own rendezvous package is still being imported.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """What torch's entry-point loader calls: returns the handler creator."""
    return create_barrier_handler


def create_barrier_handler(params: RendezvousParameters) -> RendezvousHandler:
    from ftrun.config.rendezvous import RendezvousConfig
    from ftrun.rendezvous.barrier import BarrierRendezvousHandler
    from ftrun.rendezvous.ranks import NodeDescriptor
    from ftrun.store.connect import connect_store

    config = RendezvousConfig(
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=float(params.get("join_timeout", 600)),
        last_call_timeout=float(params.get("last_call_timeout", 30)),
        is_host=params.get_as_bool("is_host"),
        local_addr=params.local_addr,
    )
    store, _ = connect_store(config.store)
    host = params.local_addr or socket.getfqdn()
    return BarrierRendezvousHandler(
        config,
        store,
        lambda: NodeDescriptor(
            node=f"{host}-{os.getpid()}",
            host=host,
            local_world_size=params.get_as_int("local_world_size", 1) or 1,
            master_port=0,
        ),
    )
