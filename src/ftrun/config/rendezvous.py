"""Rendezvous configuration (built by `ftrun.ft_launcher.build` only)."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from types import MappingProxyType

from ftrun.config.store import StoreConfig

_NOT_IN_FILE_NAMES = re.compile(r"[^A-Za-z0-9._-]")


def run_id_in_file_name(run_id: str) -> str:
    """The run id as part of a file name: characters other than [A-Za-z0-9._-] become '_', at
    most 64 of them (a run id is any text the user gave --rdzv-id)."""
    return _NOT_IN_FILE_NAMES.sub("_", run_id)[:64]


class RendezvousImpl(str, enum.Enum):
    """Which rendezvous algorithm the agents use."""

    BARRIER = "barrier"
    DYNAMIC = "dynamic"


@dataclasses.dataclass(frozen=True)
class RendezvousConfig:
    """Where and how the nodes of one job meet."""

    endpoint: str
    """host:port of the c10d TCPStore; the agent on that host serves it."""
    run_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    impl: RendezvousImpl = RendezvousImpl.BARRIER
    backend: str = "c10d"
    """torchrun's --rdzv-backend value, kept for compatibility (static, c10d, etcd...)."""
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    is_host: bool | None = None
    """Serve the store here (None: when the endpoint host is this machine and its port is free)."""
    store_reconnect_timeout: float = 0.0
    """> 0: the c10d store is `ftrun store`'s, no agent serves it, and the agents come through
    its restart, reconnecting for up to this many seconds (`reconnecting`)."""
    use_infra_group_rank: bool = False
    node_rank: int | None = None
    """--node-rank (static rendezvous): the group rank to take when infra ranks are used."""
    local_addr: str | None = None
    conf: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """The remaining --rdzv-conf key=value pairs."""

    @property
    def store(self) -> StoreConfig:
        """The store clients' part of these options."""
        return StoreConfig(
            endpoint=self.endpoint,
            run_id=self.run_id,
            backend=self.backend,
            is_host=self.is_host,
            reconnect_timeout=self.store_reconnect_timeout,
            read_timeout=float(self.conf.get("read_timeout", 60)),
        )
