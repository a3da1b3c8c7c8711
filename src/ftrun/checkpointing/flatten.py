"""Nested training state <-> (a JSON skeleton, a list of tensors), without pickle.

A checkpoint part stores tensors as raw bytes and everything else as JSON, so loading one can
never run code (pickle, `torch.load` and `eval` can). What can be stored:

* dicts with `str` or `int` keys (an optimizer's `state_dict()` keys its state by int; any
  `dict` subclass, e.g. `OrderedDict`, comes back as a plain `dict`: equal, but not the same
  type), lists, tuples (they come back as tuples);
* dense tensors (`torch.Tensor` or `nn.Parameter`, which comes back as a plain tensor) of a
  dtype that safetensors names (see `layout.DTYPE_NAMES`), on any device that has data: CUDA
  tensors are copied to host when the part is written;
* `None`, `bool`, `int` (any size JSON can carry), `float` (NaN and ±inf included: JSON cannot
  hold them, so the skeleton tags them), `str`;
* `bytes`, stored as a uint8 tensor and given back as `bytes`.

Anything else (functions, sets, numpy arrays, subclasses of int/float/str/tuple such as
IntEnum or namedtuple, which would come back as their base type) raises
`CheckpointFormatError` naming the path inside the state, e.g.
`state['optimizer']['param_groups'][0]['fn']: a function cannot be stored without pickle`.

Views of the same tensor memory with the same shape, strides and dtype (tied weights reached
twice) are stored once and come back as one tensor, as `torch.save` would keep them shared.
Other overlapping views are stored separately and come back independent.

Skeleton nodes: JSON scalars stand for themselves, JSON arrays are lists, and every other node
is a one-key object whose key is a tag: `{"$dict": {...}}` (str keys), `{"$kdict": [[key,
node], ...]}` (a dict with an int key: JSON object keys are strings only), `{"$tuple": [...]}`,
`{"$tensor": i}`, `{"$bytes": i}`, `{"$float": "nan" | "inf" | "-inf"}`. Because dicts are
always wrapped, a user key that looks like a tag is never mistaken for one.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftrun.checkpointing.errors import CheckpointFormatError
from ftrun.checkpointing.layout import DTYPE_NAMES

TAG_DICT = "$dict"
TAG_KEYED_DICT = "$kdict"
TAG_TUPLE = "$tuple"
TAG_TENSOR = "$tensor"
TAG_BYTES = "$bytes"
TAG_FLOAT = "$float"
ROOT = "state"
# Python refuses to turn ints of more than 4,300 digits into text (and back); stay below that
# with a bit count (13,000 bits is about 3,900 digits) so the error names the path.
_MAX_INT_BITS = 13_000
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_PLAIN_BASES = (bool, int, float, str, tuple, list)


@dataclass(frozen=True)
class Flat:
    """A state taken apart: `skeleton` is JSON-able, `tensors` are referenced by index."""

    skeleton: Any
    tensors: tuple[torch.Tensor, ...]


def flatten(state: Any) -> Flat:
    """Take `state` apart; raises `CheckpointFormatError` naming the first unstorable value."""
    walker = _Flattener()
    skeleton = walker.node(state, ROOT)
    return Flat(skeleton, tuple(walker.tensors))


def unflatten(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild a state from its skeleton; raises `ValueError` on a malformed skeleton (the
    reader turns that into `CheckpointCorruptError` naming the file)."""

    def node(item: Any) -> Any:
        if item is None or type(item) in (bool, int, float, str):
            return item
        if type(item) is list:
            return [node(v) for v in item]
        if type(item) is dict and len(item) == 1:
            ((tag, body),) = item.items()
            if tag == TAG_DICT and type(body) is dict:
                return {key: node(v) for key, v in body.items()}
            if tag == TAG_KEYED_DICT and type(body) is list:
                return {_pair_key(pair): node(pair[1]) for pair in body}
            if tag == TAG_TUPLE and type(body) is list:
                return tuple(node(v) for v in body)
            if tag == TAG_TENSOR:
                return tensors[_index(body, len(tensors))]
            if tag == TAG_BYTES:
                return _to_bytes(tensors[_index(body, len(tensors))])
            if tag == TAG_FLOAT and body in _NONFINITE:
                return _NONFINITE[body]
        raise ValueError(f"unexpected skeleton node {str(item)[:80]}")

    return node(skeleton)


class _Flattener:
    """One walk over a state: collects tensors and refuses what JSON and raw bytes can't hold."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index_of: dict[tuple[Any, ...], int] = {}
        self._open: set[int] = set()  # containers on the current path, to refuse cycles

    def node(self, value: Any, path: str) -> Any:
        kind = type(value)
        if value is None or kind in (bool, str):
            return value
        if kind is int:
            if value.bit_length() > _MAX_INT_BITS:
                raise CheckpointFormatError(
                    f"{path}: an int of {value.bit_length()} bits is too big"
                )
            return value
        if kind is float:
            return value if math.isfinite(value) else {TAG_FLOAT: str(value)}  # nan, inf, -inf
        if isinstance(value, torch.Tensor):
            return {TAG_TENSOR: self._tensor(value, path)}
        if kind is bytes:
            return {TAG_BYTES: self._append(_from_bytes(value))}
        if isinstance(value, dict) or kind in (list, tuple):
            return self._container(value, path)
        raise CheckpointFormatError(f"{path}: {_describe(value)} cannot be stored without pickle")

    def _container(self, value: dict[Any, Any] | list[Any] | tuple[Any, ...], path: str) -> Any:
        if id(value) in self._open:
            raise CheckpointFormatError(f"{path}: the state contains itself here (a cycle)")
        self._open.add(id(value))
        try:
            if isinstance(value, dict):
                if all(type(k) is str for k in value):
                    return {TAG_DICT: {k: self.node(v, f"{path}[{k!r}]") for k, v in value.items()}}
                return {
                    TAG_KEYED_DICT: [
                        [_key(k, path), self.node(v, f"{path}[{k!r}]")] for k, v in value.items()
                    ]
                }
            items = [self.node(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return items if type(value) is list else {TAG_TUPLE: items}
        finally:
            self._open.discard(id(value))

    def _tensor(self, tensor: torch.Tensor, path: str) -> int:
        _check_tensor(tensor, path)
        if tensor.numel() == 0:
            return self._append(tensor)
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor.device,
            tensor.is_conj(),
            tensor.is_neg(),
        )
        if key not in self._index_of:
            self._index_of[key] = self._append(tensor)
        return self._index_of[key]

    def _append(self, tensor: torch.Tensor) -> int:
        self.tensors.append(tensor.detach())
        return len(self.tensors) - 1


def _check_tensor(tensor: torch.Tensor, path: str) -> None:
    """Refuse tensors whose bytes alone do not describe them."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        what = f"a {type(tensor).__qualname__} (a tensor subclass; store its local tensor)"
    elif tensor.is_nested or tensor.layout != torch.strided:
        what = f"a {tensor.layout} tensor (only dense tensors)"
    elif tensor.is_quantized:
        what = "a quantized tensor (store its int_repr() and scales)"
    elif tensor.device.type == "meta":
        what = "a meta tensor (it has no data)"
    elif tensor.dtype not in DTYPE_NAMES:
        what = f"a {tensor.dtype} tensor (safetensors has no name for this dtype)"
    else:
        return
    raise CheckpointFormatError(f"{path}: {what} cannot be stored")


def _key(key: Any, path: str) -> str | int:
    if type(key) is not str and (type(key) is not int or key.bit_length() > _MAX_INT_BITS):
        raise CheckpointFormatError(
            f"{path}: dict key {str(key)[:60]!r} is a {type(key).__qualname__}; "
            "only str and int keys can be stored without pickle"
        )
    return key


def _pair_key(pair: Any) -> str | int:
    if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in (str, int):
        raise ValueError(f"unexpected keyed-dict entry {str(pair)[:80]}")
    return pair[0]


def _describe(value: Any) -> str:
    """What `value` is, in words an operator can act on."""
    kind = type(value)
    if inspect.isroutine(value) or isinstance(value, functools.partial):
        return "a function"
    if isinstance(value, (set, frozenset)):
        return f"a {kind.__name__} (store a sorted list instead)"
    if kind.__module__ == "numpy":
        return f"a numpy {kind.__name__} (use torch.from_numpy for arrays, .item() for scalars)"
    if isinstance(value, (bytearray, memoryview)):
        return f"a {kind.__name__} (convert it to bytes)"
    for base in _PLAIN_BASES:
        if isinstance(value, base):
            return (
                f"a {kind.__qualname__} (a subclass of {base.__name__} that would come back as "
                f"a plain {base.__name__}; convert it)"
            )
    return f"a {kind.__module__}.{kind.__qualname__}"


def _index(body: Any, count: int) -> int:
    if type(body) is not int or not 0 <= body < count:
        raise ValueError(f"tensor index {str(body)[:20]} out of range (the part has {count})")
    return body


def _from_bytes(value: bytes) -> torch.Tensor:
    if not value:
        return torch.empty(0, dtype=torch.uint8)
    # A bytearray: frombuffer on immutable bytes warns that the tensor would be writable.
    return torch.frombuffer(bytearray(value), dtype=torch.uint8)


def _to_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError(
            f"a bytes value must be a 1-d U8 tensor, not {tensor.dtype} {tuple(tensor.shape)}"
        )
    if tensor.numel() == 0:
        return b""
    # One copy straight out of the (mapped) tensor memory; numpy is not a dependency.
    return ctypes.string_at(tensor.data_ptr(), tensor.numel())
