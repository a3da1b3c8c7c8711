"""Local checkpoints of training state, NVRx's API, without pickle.

`LocalCheckpointManager` saves each rank's part of an iteration as one safetensors-layout file
and loads the newest iteration every rank has. Parts are written by `format`, laid out by
`layout`, kept by a `store.PartStore`; `replication` holds NVRx's clique arithmetic.
"""

from ftrun.checkpointing.async_calls import (
    AsyncCallError,
    AsyncCallsQueue,
    AsyncCallTimeoutError,
    AsyncRequest,
)
from ftrun.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointUsageError,
    CheckpointWriteError,
)
from ftrun.checkpointing.format import PartInfo, read_part, write_part
from ftrun.checkpointing.manager import CkptID, LocalCheckpointManager
from ftrun.checkpointing.replication import (
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
)
from ftrun.checkpointing.state_dict import BasicTensorAwareStateDict

__all__ = [
    "AsyncCallError",
    "AsyncCallTimeoutError",
    "AsyncCallsQueue",
    "AsyncRequest",
    "BasicTensorAwareStateDict",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointUsageError",
    "CheckpointWriteError",
    "CkptID",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "LocalCheckpointManager",
    "PartInfo",
    "read_part",
    "write_part",
]
