"""PyTorch Lightning integration (optional extra: `pip install 'ftrun[lightning]'`).

Callbacks and a checkpoint IO on top of ftrun's worker-side APIs:

- `FaultToleranceCallback`: heartbeats, "step"/"checkpointing" sections, calculated timeouts kept
  with the checkpoints, and the finished flag that `slurm/` reads (`ending`);
- `FaultToleranceSectionsCallback`: NVRx's section-only variant ("setup", "step",
  "checkpointing"), its timeouts kept in a JSON file (`sections`);
- `PreemptionCallback`: on the launcher's SIGTERM, save at a step end and stop cleanly;
- `HierarchicalCheckpointIO`: local checkpoints every N steps beside the global ones, and a
  resume from the newest good copy;
- `StragglerDetectionCallback`: NVRx's callback over `ftrun.straggler` (see `straggler`).

Works with `pytorch_lightning` or `lightning.pytorch` (see `_compat`).
"""

from ftrun.lightning.checkpoint_io import NEWEST, HierarchicalCheckpointIO
from ftrun.lightning.ending import Ending, classify, request_stop
from ftrun.lightning.errors import (
    LightningIntegrationError,
    LightningUsageError,
    SimulatedFaultError,
)
from ftrun.lightning.fault_tolerance import FaultToleranceCallback
from ftrun.lightning.local_callback import LocalCheckpointCallback
from ftrun.lightning.nvrx_io import LOCAL_CKPT_OPTS_KEY
from ftrun.lightning.preemption import PreemptionCallback
from ftrun.lightning.sections import FaultToleranceSectionsCallback
from ftrun.lightning.simulated_fault import SimulatedFault, SimulatedFaultParams
from ftrun.lightning.straggler import StragglerDetectionCallback

__all__ = [
    "LOCAL_CKPT_OPTS_KEY",
    "NEWEST",
    "Ending",
    "FaultToleranceCallback",
    "FaultToleranceSectionsCallback",
    "HierarchicalCheckpointIO",
    "LightningIntegrationError",
    "LightningUsageError",
    "LocalCheckpointCallback",
    "PreemptionCallback",
    "SimulatedFault",
    "SimulatedFaultError",
    "SimulatedFaultParams",
    "StragglerDetectionCallback",
    "classify",
    "request_stop",
]
