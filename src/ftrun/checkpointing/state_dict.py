"""`BasicTensorAwareStateDict`: NVRx's wrapper name, so NVRx training code runs unchanged.

NVRx's checkpoint manager takes its state as a `TensorAwareStateDict`, whose basic
implementation wraps a plain state dict (and moves tensors between devices itself). Ours only
carries the dict: `LocalCheckpointManager` copies tensors to host when it writes, and hands back
a wrapper from `load` exactly when a wrapper was saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class BasicTensorAwareStateDict:
    """A state dict wrapped as NVRx's manager expects; `.state_dict` is the dict itself.

    Tensors may be on any device (NVRx's version insists on CUDA).
    """

    state_dict: dict[str, Any]
