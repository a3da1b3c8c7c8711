"""The random state a re-run must start from: Python's, torch's (CPU and every CUDA device's)
and whatever the user's `state_save_func` returns, captured before a step and restored before
its re-run (in place, or elsewhere from a checkpoint: every value is storable without pickle).
NumPy's global generator is not captured (seed a `numpy.random.Generator` from torch's)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


def capture(save: Callable[[], Any] | None) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    state["user"] = save() if save is not None else None
    return state


def restore(state: dict[str, Any] | None, load: Callable[[Any], None] | None) -> None:
    if not state:
        return
    import torch

    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    torch.set_rng_state(state["torch"].cpu() if hasattr(state["torch"], "cpu") else state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if load is not None and state.get("user") is not None:
        load(state["user"])
