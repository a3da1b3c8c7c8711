"""Functional composition of the wrapper's hooks (NVRx's `inprocess.Compose`).

`Compose(a, b, c)(x) == a(b(c(x)))`. The composed object is an instance of the instances' lowest
common base class, so `Compose(AbortA(), AbortB())` is an `Abort` and passes the wrapper's type
checks for its `abort=` argument. The dynamic subclasses are cached per base class.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from typing import Any


class Compose:
    """Chains callables, last one first; each stage's return value is the next stage's argument.

    A stage may return a tuple to pass several arguments on. A stage that received an argument
    other than None and returned None gets a warning: it most likely forgot `return state`.
    """

    instances: tuple[Callable[..., Any], ...]
    _base: type = object

    def __new__(cls, *instances: Callable[..., Any]) -> Compose:
        if not instances:
            raise ValueError("Compose needs at least one callable")
        return object.__new__(_kind(instances))

    def __init__(self, *instances: Callable[..., Any]) -> None:
        self.instances = instances

    def __call__(self, *args: Any) -> Any:
        ret: Any = None
        for instance in reversed(self.instances):
            ret = instance(*args)
            if ret is None and args and args != (None,):
                warnings.warn(f"{type(self).__name__}: {instance!r} returned None for {args!r}; "
                              "the next stage gets None", stacklevel=2)  # fmt: skip
            if isinstance(ret, tuple):
                args = ret
            elif ret is None and not args:
                args = ()  # a chain of argument-less callables stays argument-less
            else:
                args = (ret,)
        return ret

    def __repr__(self) -> str:
        inner = ", ".join(repr(instance) for instance in self.instances)
        return f"Compose({inner})"


def _effective_type(instance: object) -> type:
    """A Compose counts as its base, so that Compose(Compose(a, b), c) composes like a, b, c."""
    return instance._base if isinstance(instance, Compose) else type(instance)


def _kind(instances: tuple[object, ...]) -> type:
    """The Compose subclass deriving from the lowest class every instance is an instance of:
    the first such class in the first instance's MRO that can be subclassed (a plain function's
    class cannot: lambdas compose as a bare Compose) and leaves nothing abstract but
    `__call__` (which Compose provides)."""
    kinds = [_effective_type(instance) for instance in instances]
    for candidate in kinds[0].__mro__:
        if all(issubclass(kind, candidate) for kind in kinds[1:]):
            try:
                kind = _subclass_for(candidate)
            except TypeError:
                continue  # "not an acceptable base type", a layout conflict, ...
            if not getattr(kind, "__abstractmethods__", None):
                return kind
    return _subclass_for(object)


@functools.cache
def _subclass_for(base: type) -> type:
    """The cached Compose subclass that also derives from `base` (its metaclass included)."""
    bases: tuple[type, ...] = (Compose,) if base is object else (Compose, base)

    def body(namespace: dict[str, Any]) -> None:
        namespace["_base"] = base
        namespace["__module__"] = __name__

    return types.new_class(f"Compose[{base.__name__}]", bases, exec_body=body)
