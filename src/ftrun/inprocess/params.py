"""Handing the `CallWrapper` to the wrapped function, as NVRx does: by annotation.

A parameter named `call_wrapper` without an annotation gets it too, with one warning at wrap
time: NVRx would pass it nothing, and every call of the function would fail the same way
(`'NoneType' object has no attribute 'iteration'`), restart after restart."""

from __future__ import annotations

import inspect
import typing
import warnings
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
        if _names_call_wrapper(parameter.annotation) or _unannotated(parameter):
            bound.arguments[name] = call_wrapper
    return bound.args, bound.kwargs


def check_call_wrapper_parameters(fn: Callable[..., Any]) -> None:
    """Warn, once at wrap time, of a `call_wrapper` parameter without the annotation NVRx
    needs to pass it (ftrun passes it anyway)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or a C function: nothing to inject into
        return
    for parameter in parameters:
        if _unannotated(parameter):
            where = getattr(fn, "__qualname__", repr(fn))
            warnings.warn(f"ftrun.inprocess.Wrapper: {where}'s parameter '{parameter.name}' "
                          "is not annotated CallWrapper: ftrun passes it the CallWrapper "
                          "anyway, NVRx would pass nothing (annotate it `call_wrapper: "
                          "CallWrapper`)", stacklevel=3)  # fmt: skip


def _unannotated(parameter: inspect.Parameter) -> bool:
    return parameter.name == "call_wrapper" and parameter.annotation is inspect.Parameter.empty


def _names_call_wrapper(annotation: object) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):  # `from __future__ import annotations` in the user's module
        return "CallWrapper" in annotation
    if getattr(annotation, "__name__", None) == "CallWrapper":
        return True
    return any(_names_call_wrapper(arg) for arg in typing.get_args(annotation))
