"""Local checkpoints of training state, NVRx's API, without pickle.

`LocalCheckpointManager` saves each rank's part of an iteration as one safetensors-layout file
and loads the newest iteration every rank has. Parts are written by `part_write`, read by
`format`, laid out by `layout`, kept by a `store.PartStore`; `replication` holds NVRx's clique
arithmetic.
`GlobalCheckpointManager` saves to shared storage through DCP; `restore` takes the newest good
copy across tiers.

A part's way under ft_launcher, step by step:
1. `manager.save` writes the part into node memory (`FTRUN_CKPT_DIR`, the agent's directory,
   see `tier_files`) through `store.DirectoryStore` (reusing a retired part's file,
   `recycled`), and the session's `POLICY_FILE` says how to replicate (`worker_tier`);
2. with `persist_to_disk`, the save copies it under `root_local_ckpt_dir` too (`persist`);
3. the node agent's keeper (`keeper.replicator`, a thread) sees the new part and pushes it over
   the peer channel to the agents of the other ranks of its clique (`replication`,
   `keeper.holdings.push_targets`), which install it in their node memory (`keeper.transfer`);
4. it then protects the newest iteration this node holds whole (`PROTECTED_FILE`), so that
   neither the workers' clean-up nor the replicas' drops it;
5. after a failure, before the new round's workers start, the keepers agree on the newest
   iteration complete for every rank and fetch what a replacement node lacks from the peers
   that hold it (`keeper.restore`), and write the decision (`RESTORE_FILE`);
6. the restarted worker's `find_latest`/`load` read that decision and the part from node memory.
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
from ftrun.checkpointing.format import PartInfo, read_part
from ftrun.checkpointing.manager import CkptID, LocalCheckpointManager
from ftrun.checkpointing.part_write import write_part
from ftrun.checkpointing.replication import (
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
)
from ftrun.checkpointing.snapshot import StepSnapshot
from ftrun.checkpointing.state_dict import BasicTensorAwareStateDict, TensorAwareStateDict
from ftrun.checkpointing.torch_async import TorchAsyncCheckpoint
from ftrun.lazy import lazy_getattr

# The global tier and `restore` import torch.distributed.checkpoint (~0.5 s): only when used,
# so that a worker that saves locally restarts without paying for it.
_LAZY = {
    "FileSystemWriterAsync": "ftrun.checkpointing.dcp_async",
    "init_checkpoint_metadata_cache": "ftrun.checkpointing.dcp_async",
    "save_state_dict_async_finalize": "ftrun.checkpointing.dcp_async",
    "save_state_dict_async_plan": "ftrun.checkpointing.dcp_async",
    "GlobalCheckpointConfig": "ftrun.checkpointing.global_tier",
    "GlobalCheckpointManager": "ftrun.checkpointing.global_tier",
    "GlobalTier": "ftrun.checkpointing.hierarchy",
    "LocalTier": "ftrun.checkpointing.hierarchy",
    "Restored": "ftrun.checkpointing.hierarchy",
    "Tier": "ftrun.checkpointing.hierarchy",
    "restore": "ftrun.checkpointing.hierarchy",
}


__getattr__ = lazy_getattr(__name__, _LAZY)

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
    "FileSystemWriterAsync",
    "GlobalCheckpointConfig",
    "GlobalCheckpointManager",
    "GlobalTier",
    "LazyCliqueReplicationStrategy",
    "LocalCheckpointManager",
    "LocalTier",
    "PartInfo",
    "Restored",
    "StepSnapshot",
    "TensorAwareStateDict",
    "Tier",
    "TorchAsyncCheckpoint",
    "init_checkpoint_metadata_cache",
    "read_part",
    "restore",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "write_part",
]
