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
    wire.Heartbeat(12),
    wire.Heartbeat(wire.MAX_ITERATION),
    wire.SectionStart("step"),
    wire.SectionEnd("step"),
    wire.SectionEnd("step", 0),
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
        (msgpack.packb([wire.VERSION + 1, "hb"]), "version"),
        (msgpack.packb([1, "nuke"]), "unknown message type"),
        (msgpack.packb([1, "hb", 1]), "takes 0 fields"),
        (msgpack.packb([0, "hb"]), "version"),
        (msgpack.packb([True, "hb"]), "version"),
        (msgpack.packb([2, "hb"]), "takes 1 fields"),
        (msgpack.packb([2, "hb", -1]), "iteration"),
        (msgpack.packb([2, "hb", 2**63]), "iteration"),
        (msgpack.packb([2, "hb", 1.0]), "iteration"),
        (msgpack.packb([2, "hb", True]), "iteration"),
        (msgpack.packb([2, "hb", None]), "iteration"),
        (msgpack.packb([2, "se", "step"]), "takes 2 fields"),
        (msgpack.packb([2, "se", "", 3]), "section name"),
        (msgpack.packb([2, "se", "step", "3"]), "iteration"),
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


def test_frames_carry_the_lowest_version_that_expresses_them():
    """Without an iteration, heartbeats and section ends are the version-1 frames, byte for
    byte: a server of an older release still understands a newer client that does not use it."""
    assert wire.encode(wire.Heartbeat()) == msgpack.packb([1, "hb"])
    assert wire.encode(wire.SectionEnd("step")) == msgpack.packb([1, "se", "step"])
    assert wire.encode(wire.Heartbeat(7)) == msgpack.packb([2, "hb", 7])
    assert wire.encode(wire.SectionEnd("step", 7)) == msgpack.packb([2, "se", "step", 7])
    assert wire.encode(wire.Goodbye()) == msgpack.packb([1, "bye"])


def test_version_2_reads_unchanged_messages_as_version_1():
    assert wire.decode(msgpack.packb([2, "ss", "step"])) == wire.SectionStart("step")
    assert wire.decode(msgpack.packb([2, "hello", 1, 2, 3])) == wire.Hello(1, 2, 3)
    with pytest.raises(ProtocolError, match=f"version {wire.VERSION + 1}"):
        wire.decode(msgpack.packb([wire.VERSION + 1, "hb"]))


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


def test_progress_is_a_heartbeat_or_a_section_end_with_the_iterations_reported():
    p = progress(heartbeat=5.0)
    p.start_section("step", 101.0)  # entering a section is no progress yet
    assert (p.first_progress, p.last_progress) == (None, None)
    assert p.end_section("io", 101.2) is False  # a stray end neither
    assert p.end_section("step", 101.5, iteration=40) is True  # the first progress
    assert p.heartbeat(101.6) is False
    assert (p.first_progress, p.last_progress) == (101.5, 101.6)
    assert (p.first_iteration, p.last_iteration) == (40, 40)
    assert p.heartbeat(102.0, iteration=41) is False
    p.start_section("step", 102.1)
    assert p.end_all_sections(102.5) is False
    assert (p.first_progress, p.last_progress) == (101.5, 102.5)
    assert (p.first_iteration, p.last_iteration) == (40, 41)


def test_first_progress_without_iterations_and_from_end_all_sections():
    p = progress()
    p.start_section("a", 100.5)
    p.start_section("b", 100.6)
    assert p.end_all_sections(101.0) is True
    assert (p.first_progress, p.first_iteration, p.last_iteration) == (101.0, None, None)
    p.heartbeat(102.0, iteration=3)
    assert (p.first_iteration, p.last_iteration) == (3, 3)  # the first one reported


def test_hello_carries_the_warm_up_iterations_in_version_2() -> None:
    with_warmup = wire.Hello(1, 2, 3, warmup_iterations=7)
    assert msgpack.unpackb(wire.encode(with_warmup))[0] == 2
    assert wire.decode(wire.encode(with_warmup)) == with_warmup
    assert msgpack.unpackb(wire.encode(wire.Hello(1, 2, 3)))[0] == 1  # old servers read it
    for bad in ([1, "hello", 1, 2, 3, 7], [2, "hello", 1, 2, 3, -1], [2, "hello", 1, 2, 3, 7, 8]):
        with pytest.raises(ProtocolError):
            wire.decode(msgpack.packb(bad))


def test_warm_up_steps_are_judged_with_the_warmup_section_timeout() -> None:
    """NVRx's num_warmup_iterations: the first N step sections get the `warmup` timeout."""
    timeouts = wire.Timeouts(None, None, {"step": 1.0, "warmup": 100.0})
    progress = RankProgress(0, 1, 0.0, timeouts, warmup_iterations=2)
    deadlines = []
    for start in (0.0, 2.0, 4.0):
        progress.start_section("step", start)
        deadlines.append(progress.next_overdue().deadline)
        progress.end_section("step", start + 0.5)
    assert deadlines == [100.0, 102.0, 5.0]
    no_warmup = RankProgress(
        0, 1, 0.0, wire.Timeouts(None, None, {"step": 1.0}), warmup_iterations=2
    )
    no_warmup.start_section("step", 0.0)
    assert no_warmup.next_overdue().deadline == 1.0  # no warmup timeout given: the step's
