"""The client's timeouts as NVRx shows and saves them, and the conversions to ftrun's own form.

NVRx's `RankMonitorClient` exposes `hb_timeouts` (`HeartbeatTimeouts`) and `section_timeouts`
(`SectionTimeouts`), and its `state_dict()` is `{"current_timeouts": {"heartbeat": ...,
"section": ...}}` holding only what was calculated. ftrun's client keeps the calculated timeouts
in a compact form (`Calculated`: `{"heartbeat": {"initial", "subsequent"}, "sections": {name:
seconds}, "out_of_section": seconds}`, the form of ftrun's state_dict before 0.7 parity) and
saves NVRx's, so a checkpoint moves between the two libraries either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ftrun.errors import ProtocolError, RankMonitorClientError
from ftrun.rank_monitor import protocol as wire

NVRX_STATE_KEY = "current_timeouts"
"""NVRx's `RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY`."""
COMPACT_KEYS = frozenset({"heartbeat", "sections", "out_of_section"})

Calculated = dict[str, Any]
"""The compact form: only the timeouts that were calculated (or loaded as calculated)."""


@dataclasses.dataclass
class HeartbeatTimeouts:
    """NVRx's heartbeat timeouts: before the first heartbeat, and between two; None is off."""

    initial: float | None = None
    subsequent: float | None = None
    were_calculated: bool = False

    @property
    def are_valid(self) -> bool:
        return self.initial is not None and self.subsequent is not None


@dataclasses.dataclass
class SectionTimeouts:
    """NVRx's section timeouts: per section, out of any section, and which were calculated."""

    section: dict[str, float | None] = dataclasses.field(default_factory=dict)
    out_of_section: float | None = None
    calculated_sections: set[str] = dataclasses.field(default_factory=set)
    is_out_of_section_calculated: bool = False


def views(
    current: wire.Timeouts, calculated: Calculated
) -> tuple[HeartbeatTimeouts, SectionTimeouts]:
    """What `hb_timeouts` and `section_timeouts` show for the timeouts now in force."""
    heartbeat = HeartbeatTimeouts(
        current.initial_heartbeat, current.heartbeat, were_calculated="heartbeat" in calculated
    )
    return heartbeat, SectionTimeouts(
        section=dict(current.sections),
        out_of_section=current.out_of_section,
        calculated_sections=set(calculated.get("sections", {})),
        is_out_of_section_calculated="out_of_section" in calculated,
    )


def in_force(current: wire.Timeouts, calculated: Calculated) -> wire.Timeouts:
    """`current` with the `calculated` timeouts in place of the launcher's."""
    hb = calculated.get("heartbeat", {})
    return wire.Timeouts(
        initial_heartbeat=hb.get("initial", current.initial_heartbeat),
        heartbeat=hb.get("subsequent", current.heartbeat),
        sections={**current.sections, **calculated.get("sections", {})},
        out_of_section=calculated.get("out_of_section", current.out_of_section),
    )


def to_nvrx_state(current: wire.Timeouts | None, calculated: Calculated) -> dict[str, Any]:
    """NVRx's state_dict: the calculated timeouts only (an empty inner dict if none), with the
    rest of the section timeouts as in force (`current`; None before init)."""
    saved: dict[str, Any] = {}
    if "heartbeat" in calculated:
        hb = calculated["heartbeat"]
        saved["heartbeat"] = dataclasses.asdict(
            HeartbeatTimeouts(hb["initial"], hb["subsequent"], were_calculated=True)
        )
    sections = calculated.get("sections", {})
    if sections or "out_of_section" in calculated:
        merged = in_force(current or wire.Timeouts(), calculated)
        saved["section"] = {  # SectionTimeouts' fields, the set as a sorted list: JSON-able
            "section": merged.sections,
            "out_of_section": merged.out_of_section,
            "calculated_sections": sorted(sections),
            "is_out_of_section_calculated": "out_of_section" in calculated,
        }
    return {NVRX_STATE_KEY: saved}


def from_state(state: Mapping[str, Any]) -> Calculated:
    """The calculated timeouts of a saved state: NVRx's form or ftrun's compact one, checked
    like a message from the wire; `RankMonitorClientError` for anything else."""
    if not isinstance(state, Mapping):
        raise RankMonitorClientError("not a RankMonitorClient state_dict")
    if NVRX_STATE_KEY in state:
        compact = _from_nvrx(state[NVRX_STATE_KEY])
    elif set(state) <= COMPACT_KEYS:
        compact = dict(state)
    else:
        raise RankMonitorClientError("not a RankMonitorClient state_dict")
    return _validated(compact)


def _from_nvrx(saved: object) -> Calculated:
    if not isinstance(saved, Mapping):
        raise RankMonitorClientError(f"invalid RankMonitorClient state_dict: {NVRX_STATE_KEY}")
    compact: Calculated = {}
    try:
        hb = saved.get("heartbeat")
        if hb and hb.get("were_calculated", True):
            compact["heartbeat"] = {"initial": hb["initial"], "subsequent": hb["subsequent"]}
        section = saved.get("section")
        if section:
            names = section.get("calculated_sections") or ()
            compact["sections"] = {name: section["section"][name] for name in names}
            if section.get("is_out_of_section_calculated"):
                compact["out_of_section"] = section["out_of_section"]
    except (KeyError, TypeError, AttributeError) as exc:
        raise RankMonitorClientError(f"invalid RankMonitorClient state_dict: {exc!r}") from None
    return compact


def _validated(state: Calculated) -> Calculated:
    hb = state.get("heartbeat", {})
    try:
        timeouts = wire.Timeouts.from_wire(
            [hb.get("initial"), hb.get("subsequent"), dict(state.get("sections", {})),
             state.get("out_of_section")]
        )  # fmt: skip
    except (ProtocolError, AttributeError, TypeError, ValueError) as exc:
        raise RankMonitorClientError(f"invalid RankMonitorClient state_dict: {exc}") from None
    result: Calculated = {}
    if "heartbeat" in state:
        result["heartbeat"] = {
            "initial": timeouts.initial_heartbeat,
            "subsequent": timeouts.heartbeat,
        }
    if "sections" in state:
        result["sections"] = dict(timeouts.sections)
    if "out_of_section" in state:
        result["out_of_section"] = timeouts.out_of_section
    return result
