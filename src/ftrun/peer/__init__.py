"""The agent-to-agent peer channel: job-bound, versioned, bulk-capable request/reply over TCP.

Each agent may run a `PeerServer` on its advertised host (an OS-picked port, published to the
other nodes as `NodeDescriptor.peer_port`) and talk to the others' with a `PeerClient`. Both
prove membership of the job with the job's secret from the store (`job_secret`, `auth`);
frames are length-prefixed JSON headers followed by raw bulk bytes (`protocol`). Nodes still
coordinate through the store only; this channel moves data (checkpoint bytes) between them.
"""

from ftrun.peer.auth import job_secret
from ftrun.peer.client import PeerClient
from ftrun.peer.protocol import (
    PROTOCOL_VERSION,
    FileRegion,
    PeerError,
    PeerHandshakeError,
    PeerProtocolError,
    PeerRemoteError,
    PeerTimeoutError,
)
from ftrun.peer.server import PeerServer, Reply, Request

__all__ = [
    "PROTOCOL_VERSION",
    "FileRegion",
    "PeerClient",
    "PeerError",
    "PeerHandshakeError",
    "PeerProtocolError",
    "PeerRemoteError",
    "PeerServer",
    "PeerTimeoutError",
    "Reply",
    "Request",
    "job_secret",
]
