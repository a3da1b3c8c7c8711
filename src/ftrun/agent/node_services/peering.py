"""The node's end of the peer channel (`ftrun.peer`) as a node service.

It serves the other agents of this job only (the job's secret comes from the store), on the
node's advertised host; its port goes into this node's descriptor. Services that move bulk data
between nodes (the checkpoint keeper) register their request kinds on `server`; `client`
reaches the other nodes' servers. It answers `node` (this node's name) itself, so that a peer
can check whom it reached.
"""

from __future__ import annotations

from torch.distributed import Store

from ftrun.peer import PeerClient, PeerError, PeerServer, job_secret
from ftrun.rendezvous.ranks import NodeDescriptor
from ftrun.services import NodeService

_PROBE_TIMEOUT_S = 2.0


class PeerService(NodeService):
    name = "peer channel"

    def __init__(self, store: Store, run_id: str, host: str, node: str) -> None:
        self._store, self._prefix = store, f"ftrun/{run_id}"
        self._secret = job_secret(store, self._prefix)
        self.server = PeerServer(host, self._secret, run_id)
        self.server.register("node", lambda _request: {"node": node})
        self.server.start()
        self.client = PeerClient(self._secret, run_id)

    def answers(self, descriptor: NodeDescriptor) -> bool:
        """Whether the agent behind `descriptor` still serves its channel (a rendezvous probe:
        a dead agent's port refuses at once; a dead host's, within the timeout)."""
        try:
            reply, _ = self.client.request(
                descriptor.host, descriptor.peer_port, "node", timeout=_PROBE_TIMEOUT_S
            )
        except (PeerError, OSError):
            return False
        return reply.get("node") == descriptor.node

    def restore(self) -> None:
        """Write the job's secret back into a store that restarted empty (every agent of the
        job has the same one: the first to write it wins)."""
        job_secret(self._store, self._prefix, self._secret)

    def close(self) -> None:
        self.client.close()
        self.server.close()
