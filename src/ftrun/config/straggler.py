"""The agents' straggler settings: the frozen `StragglerConfig`, and changes to it at runtime.

The launcher builds it from the `--ft-straggler-*` options. While the job runs, the file
`<log dir>/straggler.json` (written by `ftrun straggler`) overrides any of its fields: every
agent looks at the file once per report interval (one `stat`), so a change takes effect within
an interval. Torch-free: the launcher and `ftrun` import it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrun.errors import ConfigError

DEFAULT_THRESHOLD = 0.75
"""NVRx's `identify_stragglers` default for every score kind."""
DEFAULT_REPORT_INTERVAL = 60.0
"""Seconds between reports when neither the launcher nor a worker says (NVRx's default)."""
CONTROL_FILE = "straggler.json"
"""In the launcher's --log-dir: runtime overrides of `StragglerConfig` fields (JSON object)."""


class StragglerAction(str, enum.Enum):
    """What the agents do about a straggler, besides reporting it."""

    LOG = "log"
    """Report text in the log and `straggler` events only."""
    STOP = "stop"
    """End the job (exit 3, do not relaunch), as a worker's ShutdownWorkload request does."""
    EXCLUDE = "exclude"
    """End the cycle without the slowest straggler's node, when the job's minimum size or a
    standby node allows it; else only log."""


@dataclasses.dataclass(frozen=True)
class StragglerConfig:
    """Report interval, thresholds (NVRx's names) and action."""

    enabled: bool = True
    report_interval: float | None = None
    """Seconds between reports; None (not given): the workers' `report_time_interval`, else
    `DEFAULT_REPORT_INTERVAL` (see `adopt`)."""
    gpu_relative_threshold: float = DEFAULT_THRESHOLD
    gpu_individual_threshold: float = DEFAULT_THRESHOLD
    section_relative_threshold: float = DEFAULT_THRESHOLD
    section_individual_threshold: float = DEFAULT_THRESHOLD
    action: StragglerAction = StragglerAction.LOG
    scores_to_print: int = 5
    """Worst and best ranks listed per score kind in the log (all when there are few)."""
    history: int = 16
    """Intervals of a rank's past that its individual reference is taken from."""

    def __post_init__(self) -> None:
        interval = self.report_interval
        if interval is not None and not (math.isfinite(interval) and interval > 0):
            raise ConfigError(f"straggler report_interval must be > 0, not {self.report_interval}")
        for name in _THRESHOLDS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise ConfigError(f"straggler {name} must be in [0, 1], not {value!r}")
        if self.scores_to_print < 1 or self.history < 2:
            raise ConfigError("straggler scores_to_print must be >= 1 and history >= 2")

    def thresholds(self) -> dict[str, float]:
        """`Report.identify_stragglers` keyword arguments."""
        return {
            "gpu_rel_threshold": self.gpu_relative_threshold,
            "gpu_indiv_threshold": self.gpu_individual_threshold,
            "section_rel_threshold": self.section_relative_threshold,
            "section_indiv_threshold": self.section_individual_threshold,
        }

    def with_overrides(self, overrides: Mapping[str, Any]) -> StragglerConfig:
        """This config with `overrides` (field -> JSON value) applied; `ConfigError` if bad."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in fields:
                raise ConfigError(f"unknown straggler setting {key!r} (known: {', '.join(fields)})")
            changes[key] = _parsed(key, value)
        return dataclasses.replace(self, **changes)


_THRESHOLDS = (
    "gpu_relative_threshold",
    "gpu_individual_threshold",
    "section_relative_threshold",
    "section_individual_threshold",
)


def _parsed(key: str, value: Any) -> Any:
    try:
        if key == "action":
            return StragglerAction(value)
        if key == "enabled":
            if not isinstance(value, bool):
                raise ValueError("not a boolean")
            return value
        if key in ("scores_to_print", "history"):
            if type(value) is not int:
                raise ValueError("not an integer")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("not a number")
        return float(value)
    except ValueError as exc:
        raise ConfigError(f"straggler setting {key}={value!r}: {exc}") from None


class ControlFile:
    """`<log dir>/straggler.json`, read again whenever its modification time or size changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None

    def changed(self) -> dict[str, Any] | None:
        """The overrides if the file changed since the last call ({} once it is removed)."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            if self._seen is None:
                return None
            self._seen = None
            return {}
        mark = (stat.st_mtime_ns, stat.st_size)
        if mark == self._seen:
            return None
        self._seen = mark
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.path}: not a JSON object ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{self.path}: not a JSON object")
        return data


def write_control(log_dir: Path, overrides: Mapping[str, Any], base: StragglerConfig) -> Path:
    """Merge `overrides` into the control file (checked against `base`), atomically."""
    path = log_dir / CONTROL_FILE
    current: dict[str, Any] = {}
    if path.exists():
        current = ControlFile(path).changed() or {}
    merged = {**current, **overrides}
    base.with_overrides(merged)  # refuse what the agents would refuse
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # not owned_dir.replace_file: config is data
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def threshold(raw: Any) -> float:
    """A score threshold from an option's raw value: a number in [0, 1]."""
    try:
        value = float(raw if isinstance(raw, (int, float)) else str(raw).strip())
    except ValueError:
        raise ValueError(f"expected a number in [0, 1], got {raw!r}") from None
    if not 0 <= value <= 1:
        raise ValueError(f"must be in [0, 1], got {raw!r}")
    return value
