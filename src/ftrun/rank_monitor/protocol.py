"""The monitor wire protocol: message types, one `encode`, one validating `decode`.

Transport: a ZeroMQ DEALER (one per rank) talks to the node's ROUTER over `ipc://` in the
per-job 0700 directory, so the peer is always a process of the same user. Each message is one
msgpack frame holding an array `[version, type, *fields]`; nothing is ever unpickled.

Versions: a frame carries the lowest version that can express it, and `decode` accepts every
version from `MIN_VERSION` to `VERSION`, each with its own exact field count. Version 2 added
the iteration a rank reports with HEARTBEAT and SECTION_END: without one, those frames are the
version-1 frames they always were (byte for byte), so a client and a server of different
releases still understand each other unless the iteration is used. Version 3 added the
straggler detector's settings to TIMINGS (`DetectorSettings`, sent once by `Detector.initialize`
in a frame without durations); TIMINGS frames without them are version-1 frames.

Fire-and-forget (client -> server, no reply): HEARTBEAT, SECTION_START, SECTION_END,
END_ALL_SECTIONS, GOODBYE, TIMINGS (a straggler detector's batch of section durations) and
INPROCESS (a wrapped rank's `inprocess_protocol.Report`). The last two name their rank and pid
themselves, so they need no HELLO on their connection (see `timings`).
Request/reply (the reply echoes `seq`): HELLO, CALC_TIMEOUTS, SET_TIMEOUTS, CONTROL (a workload
control request). The server answers a request with REPLY
(`ok`, `error`, `data`). A new message type needs no new version: a server that predates it
drops the frame as of an unknown type, and the client's request times out.

The server stamps every message with its own monotonic clock on receipt: ranks and server share
the host, and a heartbeat frame without a timestamp can be encoded once and re-sent as is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeAlias

import msgpack

from ftrun.errors import ProtocolError
from ftrun.inprocess_protocol import Report
from ftrun.rank_monitor.timings import (
    DetectorSettings,
    SectionTimes,
    parse_sections,
    parse_settings,
)
from ftrun.rank_monitor.workload import MAX_DESCRIPTION_LEN, WorkloadAction

VERSION = 3
"""The newest protocol version, the one this side speaks."""
MIN_VERSION = 1
"""The oldest version still accepted."""
MAX_ITERATION = 2**62
MAX_MESSAGE_BYTES = 64 * 1024
MAX_NAME_LEN = 128
MAX_SECTIONS = 256
MAX_ERROR_LEN = 1000
_ACTIONS = frozenset(action.value for action in WorkloadAction)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """A rank's timeouts in seconds; `None` disables that check."""

    initial_heartbeat: float | None = None
    heartbeat: float | None = None
    sections: dict[str, float | None] = dataclasses.field(default_factory=dict)
    out_of_section: float | None = None

    def to_wire(self) -> list[Any]:
        return [self.initial_heartbeat, self.heartbeat, dict(self.sections), self.out_of_section]

    @classmethod
    def from_wire(cls, raw: object) -> Timeouts:
        if not isinstance(raw, list) or len(raw) != 4:
            raise ProtocolError("timeouts must be a list of 4 items")
        initial, heartbeat, sections, out_of_section = raw
        if not isinstance(sections, dict) or len(sections) > MAX_SECTIONS:
            raise ProtocolError(f"section timeouts must be a map of at most {MAX_SECTIONS}")
        return cls(
            initial_heartbeat=_timeout(initial, "initial heartbeat timeout"),
            heartbeat=_timeout(heartbeat, "heartbeat timeout"),
            sections={_name(k): _timeout(v, f"section {k!r} timeout") for k, v in sections.items()},
            out_of_section=_timeout(out_of_section, "out-of-section timeout"),
        )


@dataclasses.dataclass(frozen=True)
class Hello:
    """First message of a rank: who it is. Answered with REPLY(data=Timeouts wire form).
    `warmup_iterations`: the client's `num_warmup_iters` (version 2), else the server's."""

    seq: int
    rank: int
    pid: int
    warmup_iterations: int | None = None


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """The rank is alive, and made progress; `iteration`: where training is (version 2)."""

    iteration: int | None = None


@dataclasses.dataclass(frozen=True)
class SectionStart:
    """The rank entered section `name`."""

    name: str


@dataclasses.dataclass(frozen=True)
class SectionEnd:
    """The rank left section `name`; `iteration`: where training is (version 2)."""

    name: str
    iteration: int | None = None


@dataclasses.dataclass(frozen=True)
class EndAllSections:
    """The rank left every open section."""


@dataclasses.dataclass(frozen=True)
class CalcTimeouts:
    """Compute timeouts from observed intervals; REPLY carries the rank's new Timeouts."""

    seq: int
    heartbeat: bool
    sections: tuple[str, ...] | None
    """Sections to compute; `None` means every observed one, `()` none."""
    out_of_section: bool
    skip_if_not_ready: bool


@dataclasses.dataclass(frozen=True)
class SetTimeouts:
    """Apply timeouts from a saved `state_dict()`."""

    seq: int
    timeouts: Timeouts


@dataclasses.dataclass(frozen=True)
class Control:
    """A workload control request: `action` is a `WorkloadAction` value. Answered with REPLY."""

    seq: int
    action: int
    description: str


@dataclasses.dataclass(frozen=True)
class Timings:
    """Section durations of rank `rank` (process `pid`), a batch since the previous one;
    `settings`: its detector's settings (version 3), sent once, without durations."""

    rank: int
    pid: int
    sections: tuple[SectionTimes, ...]
    settings: DetectorSettings | None = None


@dataclasses.dataclass(frozen=True)
class InprocessNote:
    """Rank `rank` (process `pid`), wrapped by `ftrun.inprocess`, tells its agent `report`."""

    rank: int
    pid: int
    report: Report


@dataclasses.dataclass(frozen=True)
class Goodbye:
    """The rank stops being monitored (clean shutdown)."""


@dataclasses.dataclass(frozen=True)
class Reply:
    """The server's answer to a request with the same `seq`."""

    seq: int
    ok: bool
    error: str = ""
    data: Any = None


Message: TypeAlias = (
    Hello
    | Heartbeat
    | SectionStart
    | SectionEnd
    | EndAllSections
    | CalcTimeouts
    | SetTimeouts
    | Control
    | Timings
    | InprocessNote
    | Goodbye
    | Reply
)

_TAGS: dict[type, str] = {
    Hello: "hello",
    Heartbeat: "hb",
    SectionStart: "ss",
    SectionEnd: "se",
    EndAllSections: "ea",
    CalcTimeouts: "calc",
    SetTimeouts: "set",
    Control: "ctl",
    Timings: "tm",
    InprocessNote: "ip",
    Goodbye: "bye",
    Reply: "reply",
}


_LAST_FIELD_SINCE: dict[type, int] = {Hello: 2, Heartbeat: 2, SectionEnd: 2, Timings: 3}
"""Messages whose last field came with a version: without it (None), the older frame."""


def encode(message: Message) -> bytes:
    """The one frame that carries `message`, in the lowest version that can express it."""
    tag = _TAGS[type(message)]
    fields: list[Any] = []
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        if isinstance(value, (Timeouts, DetectorSettings, Report)):
            value = value.to_wire()
        elif field.name == "sections" and isinstance(message, Timings):
            value = [[s.name, s.gpu, list(s.durations)] for s in value]
        elif isinstance(value, tuple):
            value = list(value)
        fields.append(value)
    version = 1
    if type(message) in _LAST_FIELD_SINCE:
        if fields[-1] is None:
            fields.pop()  # the older frame
        else:
            version = _LAST_FIELD_SINCE[type(message)]
    return msgpack.packb([version, tag, *fields], use_bin_type=True)


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; anything unexpected raises `ProtocolError`."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"undecodable message: {type(exc).__name__}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise ProtocolError("message is not a [version, type, ...] array")
    version, tag, *fields = raw
    if type(version) is not int or not MIN_VERSION <= version <= VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r}")
    arities = _ARITIES.get(tag) if isinstance(tag, str) else None
    if arities is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    allowed = arities[max(since for since in arities if since <= version)]
    if len(fields) not in allowed:
        counts = " or ".join(map(str, allowed))
        raise ProtocolError(f"{tag!r} takes {counts} fields, got {len(fields)}")
    return _PARSERS[tag](fields)


def _int(value: object, what: str, low: int = 0, high: int = 2**62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"{what} must be an integer in [{low}, {high}]")
    return value


def _bool(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{what} must be a boolean")
    return value


def _name(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_LEN:
        raise ProtocolError(f"a section name must be a string of 1..{MAX_NAME_LEN} characters")
    return value


def _timeout(value: object, what: str) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ProtocolError(f"{what} must be a positive finite number or nil")
    return float(value)


def _iteration(value: object) -> int:
    return _int(value, "iteration", high=MAX_ITERATION)


def _rank(value: object) -> int:
    return _int(value, "rank", high=2**31)


def _parse_calc(fields: list[Any]) -> CalcTimeouts:
    seq, heartbeat, sections, out_of_section, skip = fields
    if sections is not None:
        if not isinstance(sections, list) or len(sections) > MAX_SECTIONS:
            raise ProtocolError("calc sections must be nil or a list of names")
        sections = tuple(_name(name) for name in sections)
    return CalcTimeouts(
        seq=_int(seq, "seq"),
        heartbeat=_bool(heartbeat, "calc heartbeat"),
        sections=sections,
        out_of_section=_bool(out_of_section, "calc out_of_section"),
        skip_if_not_ready=_bool(skip, "calc skip_if_not_ready"),
    )


def _parse_reply(fields: list[Any]) -> Reply:
    seq, ok, error, data = fields
    if not isinstance(error, str) or len(error) > MAX_ERROR_LEN:
        raise ProtocolError("reply error must be a short string")
    return Reply(seq=_int(seq, "seq"), ok=_bool(ok, "reply ok"), error=error, data=data)


def _parse_hello(fields: list[Any]) -> Hello:
    seq, rank, pid, *warmup = fields
    iterations = (_int(n, "warmup iterations", high=MAX_ITERATION) for n in warmup)
    return Hello(_int(seq, "seq"), _rank(rank), _int(pid, "pid"), *iterations)


def _parse_control(fields: list[Any]) -> Control:
    seq, action, description = fields
    if type(action) is not int or action not in _ACTIONS:
        raise ProtocolError(f"a workload action must be one of {sorted(_ACTIONS)}")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_LEN:
        raise ProtocolError(f"a description must be at most {MAX_DESCRIPTION_LEN} characters")
    return Control(seq=_int(seq, "seq"), action=action, description=description)


def _parse_timings(fields: list[Any]) -> Timings:
    rank, pid, sections, *settings = fields
    parsed = (parse_settings(s) for s in settings)
    return Timings(_rank(rank), _int(pid, "pid"), parse_sections(sections, _name), *parsed)


_ARITIES: dict[str, dict[int, tuple[int, ...]]] = {
    "hello": {1: (3,), 2: (3, 4)},  # version 2: the warm-up iterations, optional
    "hb": {1: (0,), 2: (1,)},  # version 2: the iteration
    "ss": {1: (1,)},
    "se": {1: (1,), 2: (2,)},  # version 2: the iteration
    "ea": {1: (0,)},
    "calc": {1: (5,)},
    "set": {1: (2,)},
    "ctl": {1: (3,)},
    "tm": {1: (3,), 3: (4,)},  # version 3: the detector's settings
    "ip": {1: (3,)},
    "bye": {1: (0,)},
    "reply": {1: (4,)},
}
"""Each message's field counts, by the version that set them: a frame of version v has those of
the newest entry at or below v."""
_PARSERS: dict[str, Callable[[list[Any]], Message]] = {
    "hello": _parse_hello,
    "hb": lambda fields: Heartbeat(*map(_iteration, fields)),
    "ss": lambda fields: SectionStart(_name(fields[0])),
    "se": lambda fields: SectionEnd(_name(fields[0]), *map(_iteration, fields[1:])),
    "ea": lambda fields: EndAllSections(),
    "calc": _parse_calc,
    "set": lambda fields: SetTimeouts(_int(fields[0], "seq"), Timeouts.from_wire(fields[1])),
    "ctl": _parse_control,
    "tm": _parse_timings,
    "ip": lambda f: InprocessNote(_rank(f[0]), _int(f[1], "pid"), Report.from_wire(f[2])),
    "bye": lambda fields: Goodbye(),
    "reply": _parse_reply,
}
