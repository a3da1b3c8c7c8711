"""Reading `<log-dir>/events-<node>.jsonl` files into validated, immutable events.

The files are written by `eventlog.writer.EventLog`, one JSON object per line, to the schema in
`eventlog.schema` that this reader checks too. A node that was killed mid-write leaves a truncated
last line, and logs get concatenated or hand-edited, so a bad line is skipped and counted,
never fatal: a report of a bad night must still come out.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, overload

from ftrun import untrusted_json
from ftrun.eventlog.schema import COMMON, EVENTS_GLOB, NUM, SCHEMA, has_type

# Only the required fields: a line without them cannot be placed on the timeline or explained,
# so it counts as malformed. Optional fields are read with defaults.
_REQUIRED: dict[str, dict[str, str]] = {
    kind: {f.name: f.kind for f in fields if f.required} for kind, fields in SCHEMA.items()
}
_COMMON = {f.name: f.kind for f in COMMON}


class ReportInputError(Exception):
    """The log directory cannot be reported on; the message is the one line a person sees."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One line of an events file. `ts` orders events across nodes; `mono` only within one."""

    event: str
    ts: float
    mono: float
    node: str
    cycle: int
    fields: Mapping[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @overload
    def num(self, key: str, default: float = 0.0) -> float: ...
    @overload
    def num(self, key: str, default: None) -> float | None: ...
    def num(self, key: str, default: float | None = 0.0) -> float | None:
        """The field as a float; `default` where it is missing or not a number."""
        value = self.fields.get(key)
        return float(value) if has_type(value, NUM) else default


@dataclasses.dataclass(frozen=True)
class EventSet:
    """Every node's events in the order its launcher wrote them, plus what was skipped."""

    log_dir: Path
    nodes: Mapping[str, tuple[Event, ...]]
    warnings: tuple[str, ...]


def load_events(log_dir: Path) -> EventSet:
    """Parse every events file under `log_dir`; raise ReportInputError when nothing usable."""
    if not log_dir.exists():
        raise ReportInputError(f"no such directory: {log_dir}")
    if not log_dir.is_dir():
        raise ReportInputError(f"not a directory: {log_dir}")
    files = sorted(log_dir.glob(EVENTS_GLOB))
    if not files:
        raise ReportInputError(f"no {EVENTS_GLOB} files in {log_dir} (is it a --log-dir?)")
    warnings: list[str] = []
    by_node: dict[str, list[Event]] = {}
    for path in files:
        events, bad, first_bad = _read_file(path)
        if bad:
            warnings.append(
                f"skipped {bad} malformed line(s) in {path.name} (first at line {first_bad})"
            )
        for event in events:
            by_node.setdefault(event.node, []).append(event)
    if not by_node:
        raise ReportInputError(f"no valid events in {log_dir} ({len(files)} file(s) read)")
    nodes = {}
    for node, events in sorted(by_node.items()):
        nodes[node], dropped = _last_run(events)
        if dropped:
            warnings.append(
                f"{node}: events of {dropped} earlier launcher run(s) in the same file ignored"
            )
    return EventSet(log_dir, types.MappingProxyType(nodes), tuple(warnings))


def _read_file(path: Path) -> tuple[list[Event], int, int]:
    """Events of one file, the number of malformed lines and the first one's line number."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ReportInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    events: list[Event] = []
    bad, first_bad = 0, 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        event = parse_line(line)
        if event is None:
            bad += 1
            first_bad = first_bad or number
        else:
            events.append(event)
    return events, bad, first_bad


def parse_line(line: str) -> Event | None:
    """One validated event, or None when the line is not one the report can use."""
    try:
        record = untrusted_json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not _valid(record, _COMMON):
        return None
    required = _REQUIRED.get(record["event"], {})  # unknown events are kept, for later tools
    if not _valid(record, required):
        return None
    fields = types.MappingProxyType({k: v for k, v in record.items() if k not in _COMMON})
    ts, mono = float(record["ts"]), float(record["mono"])
    return Event(record["event"], ts, mono, record["node"], record["cycle"], fields)


def ints(value: object) -> tuple[int, ...]:
    """The integers of a JSON list field (true and false are not integers); () if not a list."""
    if not isinstance(value, list):
        return ()
    return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))


def _valid(record: Mapping[str, Any], schema: Mapping[str, str]) -> bool:
    return all(has_type(record.get(key), kind) for key, kind in schema.items())


def _last_run(events: Iterable[Event]) -> tuple[tuple[Event, ...], int]:
    """The events after the last-but-final `exit`, and how many runs came before.

    The launcher appends to its file, so a relaunch on the same node name (a Slurm requeue)
    continues an old file with cycles counted from 0 again: mixing runs would corrupt every
    number, and the latest run is the one a person asks about.
    """
    runs: list[list[Event]] = [[]]
    for event in events:
        runs[-1].append(event)
        if event.event == "exit":
            runs.append([])
    kept: list[list[Event]] = []
    for run in filter(None, runs):
        # Every launcher run starts with its health check. Events after an `exit` without one
        # are the same run's last words (a node service reporting as it closes), not a new run.
        if kept and not any(e.event == "health_check" for e in run):
            kept[-1] += run
        else:
            kept.append(run)
    return tuple(kept[-1]), len(kept) - 1
