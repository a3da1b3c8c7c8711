"""Per-rank progress state: what a rank did, when, and when it is next overdue.

Pure logic with an explicit clock (`now` arguments): the server feeds it received messages and
asks for deadlines; tests drive it without processes.
"""

from __future__ import annotations

import dataclasses
import enum

from ftrun.config.monitor import RankMonitorConfig
from ftrun.rank_monitor.protocol import Timeouts

STEP_SECTION, WARMUP_SECTION = "step", "warmup"
"""NVRx's section names: a training step, and the timeout of the first steps of a cycle."""


class HangKind(str, enum.Enum):
    """Why a rank was declared hung."""

    NO_FIRST_HEARTBEAT = "no first heartbeat"
    HEARTBEAT = "heartbeat"
    SECTION = "section"
    OUT_OF_SECTION = "out of section"


@dataclasses.dataclass(frozen=True)
class Overdue:
    """The next moment a rank becomes hung, and why."""

    deadline: float
    kind: HangKind
    since: float
    """When the awaited interval started (the deadline minus the timeout)."""
    section: str | None = None


class NotReadyError(ValueError):
    """Timeouts were requested for something that has not been observed yet."""


@dataclasses.dataclass
class RankProgress:
    """One rank's observed progress. Out-of-section time counts only after its first section.

    Progress, for reports, is a heartbeat or a section end (a step done), never a section start
    or a registration: `first_progress`/`last_progress` and the iterations the rank reported
    with them say when this registration started training and where it last was.
    """

    rank: int
    pid: int
    registered_at: float
    timeouts: Timeouts
    last_heartbeat: float | None = None
    first_heartbeat_delay: float | None = None
    open_sections: dict[str, float] = dataclasses.field(default_factory=dict)
    out_of_section_since: float | None = None
    longest_heartbeat_interval: float | None = None
    longest_section: dict[str, float] = dataclasses.field(default_factory=dict)
    longest_out_of_section: float | None = None
    first_progress: float | None = None
    last_progress: float | None = None
    first_iteration: int | None = None
    last_iteration: int | None = None
    warmup_iterations: int = 0
    """While fewer `step` sections than this have ended, an open `step` is judged with the
    `warmup` section timeout, if one is configured (NVRx's num_warmup_iterations)."""
    steps_done: int = 0

    def heartbeat(self, now: float, iteration: int | None = None) -> bool:
        """Record a heartbeat; True when it is the rank's first progress."""
        if self.last_heartbeat is None:
            self.first_heartbeat_delay = now - self.registered_at
        else:
            self.longest_heartbeat_interval = _longest(
                self.longest_heartbeat_interval, now - self.last_heartbeat
            )
        self.last_heartbeat = now
        return self._progressed(now, iteration)

    def start_section(self, name: str, now: float) -> None:
        if not self.open_sections and self.out_of_section_since is not None:
            self.longest_out_of_section = _longest(
                self.longest_out_of_section, now - self.out_of_section_since
            )
        self.out_of_section_since = None
        self.open_sections.setdefault(name, now)

    def end_section(self, name: str, now: float, iteration: int | None = None) -> bool:
        """Record a section end; True when it is the rank's first progress."""
        started = self.open_sections.pop(name, None)
        if started is None:
            return False  # the client validates; a stray end must not break monitoring
        self.longest_section[name] = _longest(self.longest_section.get(name), now - started)
        if name == STEP_SECTION:
            self.steps_done += 1
        if not self.open_sections:
            self.out_of_section_since = now
        return self._progressed(now, iteration)

    def end_all_sections(self, now: float) -> bool:
        first = False
        for name in list(self.open_sections):
            first |= self.end_section(name, now)
        return first

    def _progressed(self, now: float, iteration: int | None) -> bool:
        first = self.first_progress is None
        if first:
            self.first_progress = now
        self.last_progress = now
        if iteration is not None:
            if self.first_iteration is None:
                self.first_iteration = iteration
            self.last_iteration = iteration
        return first

    def next_overdue(self) -> Overdue | None:
        """The earliest deadline among the enabled checks, or None if nothing is watched."""
        t = self.timeouts
        if self.last_heartbeat is None:
            found = [_overdue(HangKind.NO_FIRST_HEARTBEAT, self.registered_at, t.initial_heartbeat)]
        else:
            found = [_overdue(HangKind.HEARTBEAT, self.last_heartbeat, t.heartbeat)]
        for name, started in self.open_sections.items():
            found.append(_overdue(HangKind.SECTION, started, self._section_timeout(name), name))
        if (since := self.out_of_section_since) is not None:
            found.append(_overdue(HangKind.OUT_OF_SECTION, since, t.out_of_section))
        return min((c for c in found if c is not None), key=lambda c: c.deadline, default=None)

    def _section_timeout(self, name: str) -> float | None:
        sections = self.timeouts.sections
        warming = name == STEP_SECTION and self.steps_done < self.warmup_iterations
        if warming and WARMUP_SECTION in sections:
            return sections[WARMUP_SECTION]
        return sections.get(name)

    def calculated_timeouts(
        self,
        safety_factor: float,
        heartbeat: bool,
        sections: tuple[str, ...] | None,
        out_of_section: bool,
        skip_if_not_ready: bool,
    ) -> Timeouts:
        """New timeouts = safety_factor x the longest observed interval, per check."""
        t = self.timeouts
        initial, hb, out = t.initial_heartbeat, t.heartbeat, t.out_of_section
        section_timeouts = dict(t.sections)
        missing: list[str] = []
        if heartbeat:
            if self.longest_heartbeat_interval is None or self.first_heartbeat_delay is None:
                missing.append("heartbeat intervals (need >= 2 heartbeats)")
            else:
                hb = safety_factor * self.longest_heartbeat_interval
                initial = max(hb, safety_factor * self.first_heartbeat_delay)
        names = tuple(self.longest_section) if sections is None else sections
        for name in names:
            if name in self.longest_section:
                section_timeouts[name] = safety_factor * self.longest_section[name]
            else:
                missing.append(f"section {name!r} (never completed)")
        if out_of_section:
            if self.longest_out_of_section is None:
                missing.append("out-of-section intervals (need a section after a section)")
            else:
                out = safety_factor * self.longest_out_of_section
        if missing and not skip_if_not_ready:
            raise NotReadyError("not observed yet: " + ", ".join(missing))
        return Timeouts(initial, hb, section_timeouts, out)


def _longest(previous: float | None, interval: float) -> float:
    return interval if previous is None else max(previous, interval)


def _overdue(
    kind: HangKind, since: float, timeout: float | None, section: str | None = None
) -> Overdue | None:
    if timeout is None:
        return None
    return Overdue(deadline=since + timeout, kind=kind, since=since, section=section)


def floored(config: RankMonitorConfig, timeouts: Timeouts) -> Timeouts:
    """`timeouts` with every calculated or loaded value raised to the floor; a value equal
    to the configured one (explicit) is kept as it is."""
    given = initial_timeouts(config)

    def floor(value: float | None, explicit: float | None) -> float | None:
        if value is None or value == explicit:
            return value
        return max(value, config.calculated_timeout_floor)

    return Timeouts(
        initial_heartbeat=floor(timeouts.initial_heartbeat, given.initial_heartbeat),
        heartbeat=floor(timeouts.heartbeat, given.heartbeat),
        sections={n: floor(v, given.sections.get(n)) for n, v in timeouts.sections.items()},
        out_of_section=floor(timeouts.out_of_section, given.out_of_section),
    )


def initial_timeouts(config: RankMonitorConfig) -> Timeouts:
    """The timeouts a rank starts with, before any calculation or loaded state."""
    return Timeouts(
        initial_heartbeat=config.initial_rank_heartbeat_timeout,
        heartbeat=config.rank_heartbeat_timeout,
        sections=dict(config.rank_section_timeouts),
        out_of_section=config.rank_out_of_section_timeout,
    )
