"""`TensorAwareStateDict` and `BasicTensorAwareStateDict`: NVRx's names and methods, so NVRx
training code runs unchanged.

NVRx's checkpoint manager takes its state as a `TensorAwareStateDict`: an object that can give
up its tensors (`pop_tensors`, leaving it "hollow"), take them back (`insert_tensors`), make
empty ones of the same shapes (`init_tensors`) and move them to and from the host. NVRx then
pickles the hollow object. ftrun never pickles: `LocalCheckpointManager` stores plain state
dicts and `BasicTensorAwareStateDict` (the wrapper of one, which NVRx's examples use); another
subclass is refused with a one-line error that says so.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class TensorAwareStateDict(ABC):
    """NVRx's interface between a training state and a checkpoint manager (see module)."""

    @abstractmethod
    def pop_tensors(self) -> Sequence[torch.Tensor]:
        """Take the tensors out (in a fixed order), leaving placeholders: the state is hollow."""

    @property
    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors, in `pop_tensors`' order."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True between `pop_tensors` and `insert_tensors`."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back where `pop_tensors` took them from."""

    @abstractmethod
    def init_tensors(self) -> None:
        """In a hollow state, empty tensors of the popped ones' shapes, dtypes and devices."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by host copies, remembering their devices."""

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to the devices `copy_tensors_to_cpu` remembered."""

    def values(self) -> Any:
        return vars(self).values()


@dataclass(frozen=True)
class _Placeholder:
    """Where a popped tensor was, and what it looked like."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass
class BasicTensorAwareStateDict(TensorAwareStateDict):
    """A state dict wrapped as NVRx's manager expects; `.state_dict` is the dict itself.

    Tensors may be on any device (NVRx's version insists on CUDA).
    """

    state_dict: dict[str, Any]
    _devices: list[torch.device] | None = field(default=None, repr=False, compare=False)

    def pop_tensors(self) -> list[torch.Tensor]:
        if self.is_hollow:
            raise RuntimeError("the state is hollow: its tensors were popped already")
        popped: list[torch.Tensor] = []

        def take(tensor: torch.Tensor) -> _Placeholder:
            popped.append(tensor)
            return _Placeholder(tensor.shape, tensor.dtype, tensor.device)

        self.state_dict = map_nested(self.state_dict, torch.Tensor, take)
        return popped

    @property
    def tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        map_nested(self.state_dict, torch.Tensor, lambda t: found.append(t) or t)
        return found

    @property
    def is_hollow(self) -> bool:
        holes: list[_Placeholder] = []
        map_nested(self.state_dict, _Placeholder, lambda p: holes.append(p) or p)
        return bool(holes)

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        supply = iter(tensor_data)

        def put(_hole: _Placeholder) -> torch.Tensor:
            try:
                return next(supply)
            except StopIteration:
                raise ValueError("fewer tensors than the state has places for") from None

        self.state_dict = map_nested(self.state_dict, _Placeholder, put)
        if next(supply, None) is not None:
            raise ValueError("more tensors than the state has places for")

    def init_tensors(self) -> None:
        self.state_dict = map_nested(
            self.state_dict,
            _Placeholder,
            lambda p: torch.empty(p.shape, dtype=p.dtype, device=p.device),
        )

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        devices: list[torch.device] = []

        def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
            devices.append(tensor.device)
            return tensor.to("cpu", non_blocking=non_blocking)

        self.state_dict = map_nested(self.state_dict, torch.Tensor, to_cpu)
        self._devices = devices

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        if self._devices is None:
            return
        devices = iter(self._devices)
        self.state_dict = map_nested(
            self.state_dict, torch.Tensor, lambda t: t.to(next(devices), non_blocking=non_blocking)
        )
        self._devices = None


def map_nested(value: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """`value` rebuilt with `fn` applied to every `kind` inside its dicts, lists and tuples.

    A dict keeps its type where its constructor allows (an OrderedDict stays one) and its
    attributes (a `state_dict()`'s `_metadata`); named tuples and other objects are kept as
    they are."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, dict):
        mapped = {k: map_nested(v, kind, fn) for k, v in value.items()}
        try:
            rebuilt = type(value)(mapped)
        except TypeError:
            return mapped
        if hasattr(value, "__dict__"):
            rebuilt.__dict__.update(value.__dict__)
        return rebuilt
    if isinstance(value, list):
        return [map_nested(v, kind, fn) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(map_nested(v, kind, fn) for v in value)
    return value
