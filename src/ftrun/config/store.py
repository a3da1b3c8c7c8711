"""Where the job's store is and how an agent reaches it: the store clients' own configuration,
a view of the launcher's rendezvous options (`RendezvousConfig.store`)."""

from __future__ import annotations

import dataclasses
import datetime


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    endpoint: str
    """host:port of the c10d TCPStore (served by an agent or by `ftrun store`), or of etcd."""
    run_id: str
    """The job's id: etcd keys live under a prefix made from it."""
    backend: str = "c10d"
    """`etcd` for the etcd store; anything else is the c10d TCPStore."""
    is_host: bool | None = None
    """Serve the store here (None: when the endpoint host is this machine and its port is free)."""
    reconnect_timeout: float = 0.0
    """> 0: no agent serves the store (`ftrun store` does) and a lost one is waited for this long
    (`reconnecting`)."""
    read_timeout: float = 60.0
    """A blocking read's bound (--rdzv-conf read_timeout)."""

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.read_timeout)
