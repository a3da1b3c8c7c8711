"""Handing the `CallWrapper` to the wrapped function, as NVRx does: by annotation."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any


def substitute_call_wrapper(
    fn: Callable[..., Any], args: tuple, kwargs: dict, call_wrapper: object
) -> tuple[tuple, dict]:
    """`args`/`kwargs` with `call_wrapper` as the value of every parameter of `fn` annotated
    `CallWrapper` or `Optional[CallWrapper]` (string annotations too), given or not."""
    signature = inspect.signature(fn)
    bound = signature.bind_partial(*args, **kwargs)
    for name, parameter in signature.parameters.items():
        if _names_call_wrapper(parameter.annotation):
            bound.arguments[name] = call_wrapper
    return bound.args, bound.kwargs


def _names_call_wrapper(annotation: object) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):  # `from __future__ import annotations` in the user's module
        return "CallWrapper" in annotation
    if getattr(annotation, "__name__", None) == "CallWrapper":
        return True
    return any(_names_call_wrapper(arg) for arg in typing.get_args(annotation))
