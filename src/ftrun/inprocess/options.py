"""`Wrapper`'s options: NVRx 0.7's keyword arguments, checked and built in this one place.

Every argument NVRx's `inprocess.Wrapper` takes is accepted. Most mean what they mean there;
the ones ftrun has no use for (it needs no monitor process and polls nothing: ranks block on
the coordination store, and under `ft_launcher` the agent sees a lost process at once) are
named in `NOT_NEEDED`, and a value other than NVRx's default gets one warning line saying why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from datetime import timedelta
from typing import Any

from ftrun.environment import Env
from ftrun.inprocess.abort import DEFAULT_ABORT_TIMEOUT_S, Abort, AbortTorchDistributed
from ftrun.inprocess.completion import Completion
from ftrun.inprocess.compose import Compose
from ftrun.inprocess.finalize import Finalize
from ftrun.inprocess.health_check import HealthCheck, default_health_checks
from ftrun.inprocess.initialize import Initialize
from ftrun.inprocess.rank_assignment import ActivateAllRanks, RankAssignment, ShiftRanks
from ftrun.inprocess.store import TCPStore
from ftrun.inprocess.terminate import Terminate

log = logging.getLogger("ftrun.inprocess")

DEFAULT_ABORT_TIMEOUT = timedelta(seconds=DEFAULT_ABORT_TIMEOUT_S)
"""How long the process groups' abort may take before in-process restart gives up on this
rank (an NCCL abort can hang): the launcher then restarts the workers."""


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


NOT_NEEDED = {
    "monitor_thread_interval": "ftrun's watcher blocks on the store instead of polling it",
    "monitor_process_interval": "ftrun runs no monitor process",
    "monitor_process_logfile": "ftrun runs no monitor process",
    "monitor_process_pidfile": "ftrun runs no monitor process",
    "heartbeat_interval": "a lost rank is seen by its launcher (ft_launcher) at once",
    "heartbeat_timeout": "a lost rank is seen by its launcher (ft_launcher) at once",
    "last_call_wait": "every rank reports at the iteration's barrier; nothing waits for stragglers",
}
"""NVRx arguments ftrun accepts and does not need, and why (warned about once if not default)."""

NVRX_DEFAULTS: dict[str, Any] = {
    "store_factory": TCPStore, "store_kwargs": None, "initialize": None, "abort": None,
    "finalize": None, "health_check": None, "rank_assignment": None,
    "monitor_thread_interval": _s(1), "monitor_process_interval": _s(1),
    "heartbeat_interval": _s(1), "progress_watchdog_interval": _s(1), "soft_timeout": _s(60),
    "hard_timeout": _s(90), "heartbeat_timeout": _s(30), "barrier_timeout": _s(120),
    "completion_timeout": _s(120), "last_call_wait": _s(1), "termination_grace_time": _s(5),
    "monitor_process_logfile": None, "monitor_process_pidfile": None, "enabled": True,
    "completion": None, "terminate": None,
}  # fmt: skip
"""NVRx 0.7's `Wrapper` defaults (`abort` and `rank_assignment`: built per Wrapper below)."""

_TYPES: dict[str, tuple[type, ...]] = {
    "store_kwargs": (dict,), "initialize": (Initialize,), "abort": (Abort,),
    "finalize": (Finalize,), "health_check": (HealthCheck,), "rank_assignment": (RankAssignment,),
    "monitor_process_logfile": (str,), "monitor_process_pidfile": (str,), "enabled": (bool,),
    "completion": (Completion,), "terminate": (Terminate,),
}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrapperOptions:
    """What one `Wrapper` does, checked."""

    store_factory: Any
    store_kwargs: dict[str, Any]
    initialize: Initialize | None
    abort: Abort | None
    finalize: Finalize | None
    health_check: HealthCheck | None
    rank_assignment: RankAssignment
    progress_watchdog_interval: timedelta
    soft_timeout: timedelta
    hard_timeout: timedelta
    barrier_timeout: timedelta
    completion_timeout: timedelta
    termination_grace_time: timedelta
    enabled: bool
    completion: Completion | None
    terminate: Terminate | None
    restart_health_check: HealthCheck | None
    """The user's check, then the checks of the GPU this rank uses (none on a CPU rank)."""
    abort_timeout: timedelta


def build_options(kwargs: dict[str, Any], environ: dict[str, str] | None = None) -> WrapperOptions:
    """Check NVRx-style keyword arguments (TypeError/ValueError as NVRx raises them)."""
    unknown = sorted(set(kwargs) - set(NVRX_DEFAULTS))
    if unknown:
        raise TypeError(f"Wrapper() got unexpected keyword argument(s): {', '.join(unknown)}")
    values = {**NVRX_DEFAULTS, **kwargs}
    if "abort" not in kwargs:
        values["abort"] = AbortTorchDistributed()
    if values["rank_assignment"] is None:
        values["rank_assignment"] = Compose(ActivateAllRanks(), ShiftRanks())
    _check_types(values)
    _check_order(values)
    for name, why in NOT_NEEDED.items():
        if name in kwargs and kwargs[name] != NVRX_DEFAULTS[name]:
            warnings.warn(f"ftrun.inprocess.Wrapper: {name} is not used: {why}", stacklevel=3)
    environ = dict(os.environ) if environ is None else environ
    values["store_kwargs"] = dict(values["store_kwargs"] or {})
    fields = {f.name for f in dataclasses.fields(WrapperOptions)}
    return WrapperOptions(
        **{name: value for name, value in values.items() if name in fields},
        restart_health_check=default_health_checks(values["health_check"]),
        abort_timeout=_abort_timeout(environ),
    )


def _check_types(values: dict[str, Any]) -> None:
    for name, default in NVRX_DEFAULTS.items():
        value, allowed = values[name], _TYPES.get(name)
        if isinstance(default, timedelta):
            allowed = (timedelta,)
        if allowed is not None and value is not None and not isinstance(value, allowed):
            wanted = " or ".join(t.__name__ for t in allowed)
            raise TypeError(f"Wrapper({name}=...) must be {wanted}, not {type(value).__name__}")
    if not callable(values["store_factory"]):
        raise TypeError("Wrapper(store_factory=...) must be callable")


def _check_order(values: dict[str, Any]) -> None:
    """NVRx's own consistency rules, so that a configuration it refuses is refused here too."""
    v = values
    rules = [
        (v["soft_timeout"] < v["hard_timeout"] < v["barrier_timeout"],
         "soft_timeout < hard_timeout < barrier_timeout"),
        (v["heartbeat_interval"] < v["heartbeat_timeout"] < v["barrier_timeout"],
         "heartbeat_interval < heartbeat_timeout < barrier_timeout"),
        (v["progress_watchdog_interval"] < v["soft_timeout"],
         "progress_watchdog_interval < soft_timeout"),
        (v["monitor_thread_interval"] < v["soft_timeout"],
         "monitor_thread_interval < soft_timeout"),
    ]  # fmt: skip
    for holds, rule in rules:
        if not holds:
            raise ValueError(f"Wrapper: needs {rule}")
    for name in ("monitor_process_logfile", "monitor_process_pidfile"):
        if v[name] is not None and not os.path.isabs(v[name]):
            raise ValueError(f"Wrapper({name}=...) must be an absolute path")


def _abort_timeout(environ: dict[str, str]) -> timedelta:
    raw = environ.get(Env.INPROCESS_ABORT_TIMEOUT)
    if raw is None:
        return DEFAULT_ABORT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{Env.INPROCESS_ABORT_TIMEOUT}={raw!r}: not seconds") from None
    if seconds <= 0:
        raise ValueError(f"{Env.INPROCESS_ABORT_TIMEOUT}={raw!r}: must be positive")
    return timedelta(seconds=seconds)
