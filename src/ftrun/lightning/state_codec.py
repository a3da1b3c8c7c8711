"""A Lightning checkpoint dict in the form ftrun's local checkpoint format stores, and back.

The local format (`ftrun.checkpointing`) stores nested dicts with str keys, lists, tuples,
tensors and plain scalars, without pickle. A Lightning checkpoint is that, except for dicts keyed
by something else: an optimizer's `state` is keyed by parameter index (int). `encode` turns such
a dict into `{ITEMS_KEY: [[key, value], ...]}` (keys that are ints, floats, bools, None, str or
tuples of those round-trip exactly); `decode` turns it back. Anything else the format cannot
hold (an object in `hyper_parameters`, say) is the format's one-line error naming where it is.

`decode` also copies every tensor: a loaded part's tensors are views of node memory that a later
save may reuse, and an optimizer's `load_state_dict` keeps the tensors it is given.
"""

from __future__ import annotations

from typing import Any

import torch

from ftrun.checkpointing import CheckpointFormatError

ITEMS_KEY = "__ftrun_items__"
_KEY_SCALARS = (int, float, bool, str, type(None))


def encode(state: Any) -> Any:
    """`state` with every dict that has a non-str key (or only ITEMS_KEY) as an items list."""
    return _encode(state, "checkpoint")


def decode(state: Any) -> Any:
    """The inverse of `encode`, with every tensor copied out of the storage it was read from."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        if set(state) == {ITEMS_KEY}:
            return {tuple(k) if isinstance(k, list) else k: decode(v) for k, v in state[ITEMS_KEY]}
        return {k: decode(v) for k, v in state.items()}
    if isinstance(state, list):
        return [decode(v) for v in state]
    if isinstance(state, tuple):
        return tuple(decode(v) for v in state)
    return state


def _encode(value: Any, path: str) -> Any:
    if isinstance(value, dict):
        if all(type(k) is str for k in value) and set(value) != {ITEMS_KEY}:
            return {k: _encode(v, f"{path}[{k!r}]") for k, v in value.items()}
        return {ITEMS_KEY: [[_key(k, path), _encode(v, f"{path}[{k!r}]")]
                            for k, v in value.items()]}  # fmt: skip
    if type(value) is list:
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(_encode(v, f"{path}[{i}]") for i, v in enumerate(value))
    return value


def _key(key: Any, path: str) -> Any:
    if all(type(k) in _KEY_SCALARS for k in (key if type(key) is tuple else (key,))):
        return key
    raise CheckpointFormatError(
        f"{path}: dict key {str(key)[:60]!r} is a {type(key).__qualname__}; "
        "keys must be str, int, float, bool, None or tuples of those"
    )
