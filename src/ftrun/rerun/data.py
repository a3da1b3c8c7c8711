"""`RerunDataIterator`: a data iterator whose step can be replayed (Megatron-Core's name).

The state machine advances it at the start of each step and rewinds it before a re-run, so the
re-run sees the same batches. Its `state_dict()` holds the step's batches, so that a re-run on
another node (after exit 16) replays them from the checkpoint rather than drawing new ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RerunDataIterator:
    """Wraps an iterator; `next()` draws from it, or replays the current step's batches."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable: Iterator[Any] = iter(iterable)
        self.saved_microbatches: list[Any] = []
        self.replaying = False
        self.replay_pos = 0

    def __iter__(self) -> RerunDataIterator:
        return self

    def __next__(self) -> Any:
        if self.replaying:
            if self.replay_pos < len(self.saved_microbatches):
                batch = self.saved_microbatches[self.replay_pos]
                self.replay_pos += 1
                return batch
            self.replaying = False  # the step asks for more than it had: draw new ones
        batch = next(self.iterable)
        self.saved_microbatches.append(batch)
        return batch

    def advance(self) -> None:
        """A new step: forget the last step's batches."""
        self.replaying = False
        self.saved_microbatches = []

    def rewind(self) -> None:
        """Re-run the step: replay its batches from the first."""
        self.replaying = True
        self.replay_pos = 0

    def state_dict(self) -> dict[str, Any]:
        """The current step's batches (the re-run elsewhere replays them)."""
        return {"saved_microbatches": list(self.saved_microbatches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved_microbatches = list(state.get("saved_microbatches", []))
        self.replaying = bool(self.saved_microbatches)
        self.replay_pos = 0
