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
    if isinstance(message, (Heartbeat, SectionEnd, Hello)):
        last = message.warmup_iterations if isinstance(message, Hello) else message.iteration
        if last is None:
            fields.pop()  # the version-1 frame
        else:
            version = 2
    elif isinstance(message, Timings):
        if message.settings is None:
            fields.pop()  # the version-1 frame
        else:
            version = 3
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
    parser = _PARSERS.get(tag) if isinstance(tag, str) else None
    if parser is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    if version >= 3 and tag in _V3_PARSERS:
        parser = _V3_PARSERS[tag]
    elif version >= 2 and tag in _V2_PARSERS:
        parser = _V2_PARSERS[tag]
    return parser(fields)


def _arity(fields: list[Any], count: int, tag: str) -> list[Any]:
    if len(fields) != count:
        raise ProtocolError(f"{tag!r} takes {count} fields, got {len(fields)}")
    return fields


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


def _parse_calc(fields: list[Any]) -> CalcTimeouts:
    seq, heartbeat, sections, out_of_section, skip = _arity(fields, 5, "calc")
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
    seq, ok, error, data = _arity(fields, 4, "reply")
    if not isinstance(error, str) or len(error) > MAX_ERROR_LEN:
        raise ProtocolError("reply error must be a short string")
    return Reply(seq=_int(seq, "seq"), ok=_bool(ok, "reply ok"), error=error, data=data)


def _parse_hello(fields: list[Any]) -> Hello:
    """3 fields (version 1), or 4 with the warm-up iterations (version 2)."""
    seq, rank, pid, *warmup = fields
    return Hello(
        seq=_int(seq, "seq"),
        rank=_int(rank, "rank", high=2**31),
        pid=_int(pid, "pid"),
        warmup_iterations=_int(warmup[0], "warmup iterations", high=MAX_ITERATION)
        if warmup
        else None,
    )


def _parse_set(fields: list[Any]) -> SetTimeouts:
    seq, timeouts = _arity(fields, 2, "set")
    return SetTimeouts(seq=_int(seq, "seq"), timeouts=Timeouts.from_wire(timeouts))


def _parse_control(fields: list[Any]) -> Control:
    seq, action, description = _arity(fields, 3, "ctl")
    if type(action) is not int or action not in _ACTIONS:
        raise ProtocolError(f"a workload action must be one of {sorted(_ACTIONS)}")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_LEN:
        raise ProtocolError(f"a description must be at most {MAX_DESCRIPTION_LEN} characters")
    return Control(seq=_int(seq, "seq"), action=action, description=description)


def _parse_timings(fields: list[Any]) -> Timings:
    """3 fields (version 1), or 4 with the detector's settings (version 3)."""
    rank, pid, sections, *settings = fields
    return Timings(
        rank=_int(rank, "rank", high=2**31),
        pid=_int(pid, "pid"),
        sections=parse_sections(sections, _name),
        settings=parse_settings(settings[0]) if settings else None,
    )


def _parse_inprocess(fields: list[Any]) -> InprocessNote:
    rank, pid, report = fields
    return InprocessNote(_int(rank, "rank", high=2**31), _int(pid, "pid"), Report.from_wire(report))


def _bare(message: Message, tag: str):
    def parse(fields: list[Any]) -> Message:
        _arity(fields, 0, tag)
        return message

    return parse


_PARSERS = {
    "hello": lambda fields: _parse_hello(_arity(fields, 3, "hello")),
    "hb": _bare(Heartbeat(), "hb"),
    "ss": lambda fields: SectionStart(_name(_arity(fields, 1, "ss")[0])),
    "se": lambda fields: SectionEnd(_name(_arity(fields, 1, "se")[0])),
    "ea": _bare(EndAllSections(), "ea"),
    "calc": _parse_calc,
    "set": _parse_set,
    "ctl": _parse_control,
    "tm": lambda fields: _parse_timings(_arity(fields, 3, "tm")),
    "ip": lambda fields: _parse_inprocess(_arity(fields, 3, "ip")),
    "bye": _bare(Goodbye(), "bye"),
    "reply": _parse_reply,
}
# Messages whose fields changed in version 2; the others read the same in every version.
_V2_PARSERS = {
    "hello": lambda fields: _parse_hello(
        fields if len(fields) == 4 else _arity(fields, 3, "hello")
    ),
    "hb": lambda fields: Heartbeat(_iteration(_arity(fields, 1, "hb")[0])),
    "se": lambda fields: _parse_section_end(_arity(fields, 2, "se")),
}


# Messages whose fields changed in version 3.
_V3_PARSERS = {"tm": lambda fields: _parse_timings(_arity(fields, 4, "tm"))}


def _parse_section_end(fields: list[Any]) -> SectionEnd:
    name, iteration = fields
    return SectionEnd(_name(name), _iteration(iteration))
