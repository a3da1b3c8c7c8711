"""Registering the barrier rendezvous with torch's handler registry (never replacing torch's).

With this, `torch.distributed.elastic` users can name `ftrun-barrier` as a rendezvous backend;
ft_launcher itself builds its handlers directly (`factory.create_rendezvous`).
"""

from __future__ import annotations

import os
import socket

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from ftrun.rendezvous.barrier import BACKEND, BarrierRendezvousHandler
from ftrun.rendezvous.config import RendezvousConfig
from ftrun.rendezvous.ranks import NodeDescriptor
from ftrun.rendezvous.store import connect_store


def create_barrier_handler(params: RendezvousParameters) -> RendezvousHandler:
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
    store, _ = connect_store(config)
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


def register() -> None:
    """Idempotent: registering the same creator twice is allowed by torch's registry."""
    rendezvous_handler_registry.register(BACKEND, create_barrier_handler)
