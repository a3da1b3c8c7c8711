"""Unit tests of the wire protocol and the per-rank tracker (no processes)."""

from __future__ import annotations

import msgpack
import pytest

from ftrun.errors import ProtocolError
from ftrun.rank_monitor import protocol as wire
from ftrun.rank_monitor.tracker import HangKind, NotReadyError, RankProgress

ROUND_TRIP = [
    wire.Hello(1, 2, 3),
    wire.Heartbeat(),
    wire.SectionStart("step"),
    wire.SectionEnd("step"),
    wire.EndAllSections(),
    wire.CalcTimeouts(4, True, ("a", "b"), False, True),
    wire.CalcTimeouts(5, False, None, True, False),
    wire.SetTimeouts(6, wire.Timeouts(1.0, 2.0, {"step": 3.0, "io": None}, None)),
    wire.Goodbye(),
    wire.Reply(7, False, "nope", None),
]


@pytest.mark.parametrize("message", ROUND_TRIP, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert wire.decode(wire.encode(message)) == message


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (b"\xc1", "undecodable"),
        (msgpack.packb({"t": "hb"}), "not a"),
        (msgpack.packb([2, "hb"]), "version"),
        (msgpack.packb([1, "nuke"]), "unknown message type"),
        (msgpack.packb([1, "hb", 1]), "takes 0 fields"),
        (msgpack.packb([1, "ss", ""]), "section name"),
        (msgpack.packb([1, "hello", 1, -1, 3]), "rank"),
        (msgpack.packb([1, "set", 1, [0, None, {}, None]]), "positive"),
        (msgpack.packb([1, "set", 1, [float("nan"), None, {}, None]]), "finite"),
        (b"\x91" + b"\x00" * wire.MAX_MESSAGE_BYTES, "exceeds"),
    ],
)
def test_bad_frames_are_refused(frame, error):
    with pytest.raises(ProtocolError, match=error):
        wire.decode(frame)


def progress(**timeouts) -> RankProgress:
    return RankProgress(0, 1, registered_at=100.0, timeouts=wire.Timeouts(**timeouts))


def test_earliest_deadline_wins_and_sections_pause_out_of_section_time():
    p = progress(initial_heartbeat=10.0, heartbeat=5.0, sections={"step": 2.0}, out_of_section=1.0)
    assert (p.next_overdue().kind, p.next_overdue().deadline) == (HangKind.NO_FIRST_HEARTBEAT, 110)
    p.heartbeat(101.0)
    p.start_section("step", 101.5)
    assert (p.next_overdue().kind, p.next_overdue().section) == (HangKind.SECTION, "step")
    assert p.next_overdue().deadline == 103.5
    p.end_section("step", 102.0)
    assert (p.next_overdue().kind, p.next_overdue().deadline) == (HangKind.OUT_OF_SECTION, 103.0)


def test_calculated_timeouts_use_the_safety_factor_and_report_what_is_missing():
    p = progress(heartbeat=60.0, sections={"step": 60.0})
    p.heartbeat(101.0)
    with pytest.raises(NotReadyError, match="heartbeat"):
        p.calculated_timeouts(5.0, True, None, False, False)
    p.heartbeat(103.0)
    p.start_section("step", 103.0)
    p.end_section("step", 103.5)
    t = p.calculated_timeouts(5.0, True, None, False, False)
    assert (t.heartbeat, t.initial_heartbeat, t.sections["step"]) == (10.0, 10.0, 2.5)
    with pytest.raises(NotReadyError, match="'io'"):
        p.calculated_timeouts(5.0, False, ("io",), False, False)
    assert p.calculated_timeouts(5.0, False, ("io",), True, True).sections == {"step": 60.0}
