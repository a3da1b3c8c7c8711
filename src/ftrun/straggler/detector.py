"""`Detector`: NVRx's straggler API (class methods, never instantiated), off the training path.

    Detector.initialize(scores_to_compute="all", gather_on_rank0=True, profiling_interval=1,
                        report_time_interval=60, node_name=None)
    with Detector.detection_section("step"):     # records a duration, nothing else
        ...
    report = Detector.generate_report_if_interval_elapsed()   # None most steps
    Detector.shutdown()

Under ft_launcher (its environment is set) the durations go to the node's agent in batches;
the agents compute the scores on one clock: `--ft-straggler-report-interval` when the launcher
was given it, else the `report_time_interval` the ranks gave `initialize` (which tells the
agent, with `node_name`: see `adopt`), and `generate_report_if_interval_elapsed()` returns each
report they publish, read from a file the node's agent keeps: it never waits on another rank.
`generate_report()` is NVRx's: a report of the durations since the last one, computed now
in-process (collective: every rank calls it at the same step), as without the launcher (see
`local`); `latest_launcher_report()` is the agents' latest report (None before their first),
without a collective.

As with NVRx, with `gather_on_rank0=True` rank 0 gets every rank's scores and the other ranks
get None; with False each rank gets its own scores only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ftrun.config.straggler import DEFAULT_REPORT_INTERVAL
from ftrun.errors import ProtocolError
from ftrun.rank_monitor.timings import parse_settings
from ftrun.straggler.channel import MonitorChannel, ReportFile, launcher_env
from ftrun.straggler.cuda import cuda_timer
from ftrun.straggler.local import IntervalTracker, LocalSink, initialized_dist, local_report
from ftrun.straggler.recorder import Recorder, Section
from ftrun.straggler.report import Report
from ftrun.straggler.scores import History

RELATIVE, INDIVIDUAL = "relative_perf_scores", "individual_perf_scores"
_CHECK_REPORT_EVERY_S = 0.05
DEFAULT_REPORT_TIME_INTERVAL = DEFAULT_REPORT_INTERVAL
"""NVRx's default `report_time_interval`."""
log = logging.getLogger("ftrun.straggler")


@dataclasses.dataclass(frozen=True)
class CallableId:
    """A callable to time: `getattr(obj, name)`. The other fields are NVRx's, accepted for
    compatibility and not used."""

    obj: object
    name: str
    arg_filter_fn: Callable[..., bool] | None = None
    extra_args_fn: Callable[..., dict] | None = None
    ignored_args: tuple[str, ...] | None = None

    def __str__(self) -> str:
        obj = self.obj
        if isinstance(obj, type):
            owner = f"{obj.__module__}.{obj.__name__}"
        elif type(obj).__name__ == "module":
            owner = getattr(obj, "__name__", str(obj))
        else:
            owner = type(obj).__name__
        return f"{owner}.{self.name}"


@dataclasses.dataclass
class _State:
    recorder: Recorder
    rank: int
    node: str
    gather_on_rank0: bool
    scores: frozenset[str]
    tracker: IntervalTracker
    local: LocalSink
    channel: MonitorChannel | None = None
    report_file: ReportFile | None = None
    history: History = dataclasses.field(default_factory=History)
    originals: list[tuple[CallableId, Any]] = dataclasses.field(default_factory=list)
    last_seq: int | None = None
    next_check: float = 0.0
    elapsed: bool = False


class Detector:
    """The straggler detector of this process (class-level state, as NVRx's)."""

    initialized: bool = False
    _state: _State | None = None

    def __new__(cls) -> Detector:
        raise RuntimeError(f"class {cls.__name__} should not be instantiated")

    @classmethod
    def initialize(
        cls,
        scores_to_compute: Sequence[str] | str = "all",
        gather_on_rank0: bool = True,
        profiling_interval: int = 1,
        report_time_interval: float = DEFAULT_REPORT_TIME_INTERVAL,
        node_name: str | None = None,
    ) -> None:
        if cls.initialized:
            raise RuntimeError("Detector.initialize() was already called")
        scores = (
            {RELATIVE, INDIVIDUAL} if str(scores_to_compute) == "all" else set(scores_to_compute)
        )
        if not scores or scores - {RELATIVE, INDIVIDUAL}:
            raise ValueError(f"scores_to_compute: 'all' or some of {RELATIVE!r}, {INDIVIDUAL!r}")
        env = launcher_env()
        channel = MonitorChannel(env[0], env[2]) if env else None
        if channel is not None:
            _announce(channel, report_time_interval, node_name)
        local = LocalSink()
        # Under the launcher: batches to the agent, and a copy for `generate_report()`.
        sinks = (channel, local) if channel else (local,)
        recorder = Recorder(sinks, profiling_interval, cuda_timer())
        cls._state = _State(
            recorder=recorder,
            rank=env[2] if env else _rank(),
            node=node_name or socket.gethostname(),
            gather_on_rank0=gather_on_rank0,
            scores=frozenset(scores),
            tracker=IntervalTracker(report_time_interval, max(1, profiling_interval)),
            channel=channel,
            report_file=ReportFile(env[1]) if env else None,
            local=local,
        )
        cls.initialized = True

    @classmethod
    def shutdown(cls) -> None:
        """Send what is left, restore wrapped callables, and forget everything."""
        state = cls._state
        if state is None:
            return
        cls.restore_original_callables()
        state.recorder.flush()
        if state.channel is not None:
            state.channel.close()
        if state.recorder.cuda is not None:
            state.recorder.cuda.close()
        cls._state = None
        cls.initialized = False

    # ---- the training path -------------------------------------------------------------------

    @classmethod
    def detection_section(cls, name: str | None = None, profile_cuda: bool = True) -> Section:
        """A context manager timing its block as section `name` (default: file:line)."""
        state = cls._require()
        if name is None:
            caller = sys._getframe(1)
            name = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        return state.recorder.section(name, profile_cuda)

    @classmethod
    def wrap_callables(cls, callable_ids: list[CallableId], profile_cuda: bool = True) -> None:
        """Time every call of each callable as the section `str(callable_id)`."""
        state = cls._require()
        for callable_id in callable_ids:
            original = getattr(callable_id.obj, callable_id.name)
            state.originals.append((callable_id, original))
            section = state.recorder.section(str(callable_id), profile_cuda)
            setattr(callable_id.obj, callable_id.name, _timed(original, section))

    @classmethod
    def restore_original_callables(cls) -> None:
        state = cls._state
        if state is None:
            return
        for callable_id, original in reversed(state.originals):
            setattr(callable_id.obj, callable_id.name, original)
        state.originals.clear()

    # ---- reports -----------------------------------------------------------------------------

    @classmethod
    def generate_report(cls) -> Report | None:
        """NVRx's: this interval's report, computed now (collective when a process group of
        several ranks is initialized: call it on every rank), shaped as NVRx's."""
        state = cls._require()
        state.recorder.flush()
        report = local_report(state.local, state.rank, state.node, state.history)
        return _shaped(report, state)

    @classmethod
    def latest_launcher_report(cls) -> Report | None:
        """Under ft_launcher, the agents' latest report (None before their first, and without
        the launcher); no collective."""
        state = cls._require()
        if state.report_file is None:
            return None
        state.recorder.flush()
        state.report_file.refresh()
        data = state.report_file.latest
        if data is None:
            return None
        state.last_seq = data.get("seq")
        return _shaped(Report.from_json(data), state)

    @classmethod
    def generate_report_if_interval_elapsed(cls) -> Report | None:
        """Call once per step on every rank: a report when one is due, else None. Under the
        launcher: when the agents published a new one (checked at most every 50 ms)."""
        state = cls._require()
        if state.report_file is None:
            state.elapsed = state.tracker.tick()
            return cls.generate_report() if state.elapsed else None
        now = time.monotonic()
        if now < state.next_check:
            state.elapsed = False
            return None
        state.next_check = now + _CHECK_REPORT_EVERY_S
        file = state.report_file
        state.elapsed = file.refresh() and (file.latest or {}).get("seq") != state.last_seq
        return cls.latest_launcher_report() if state.elapsed else None

    @classmethod
    def is_interval_elapsed(cls) -> bool:
        """Whether the last `generate_report_if_interval_elapsed` call produced a report."""
        return cls._require().elapsed

    @classmethod
    def _require(cls) -> _State:
        if cls._state is None:
            raise RuntimeError("Detector is not initialized.")
        return cls._state


def _announce(channel: MonitorChannel, report_time_interval: float, node_name: str | None) -> None:
    """Tell the node's agent what this rank was given, checked here as the agent checks it:
    settings it could not adopt are one warning in this rank's log (NVRx takes any value, and
    so does this detector without the launcher)."""
    try:
        settings = parse_settings([float(report_time_interval), node_name or None])
    except (TypeError, ValueError, ProtocolError) as exc:
        log.warning(
            "Detector.initialize: the launcher cannot adopt report_time_interval=%r, "
            "node_name=%r (%s): it reports on --ft-straggler-report-interval, else every %g s",
            report_time_interval, node_name, exc, DEFAULT_REPORT_INTERVAL,
        )  # fmt: skip
        return
    channel.announce(settings)


def _timed(fn: Callable[..., Any], section: Section) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with section:
            return fn(*args, **kwargs)

    return wrapper


def _shaped(report: Report, state: _State) -> Report | None:
    for kind in {RELATIVE, INDIVIDUAL} - state.scores:  # not asked for: left empty
        report = dataclasses.replace(report, **{f"gpu_{kind}": {}, f"section_{kind}": {}})
    if state.gather_on_rank0:
        return dataclasses.replace(report, rank=0) if state.rank == 0 else None
    return report.for_rank(state.rank)


def _rank() -> int:
    dist = initialized_dist()
    return dist.get_rank() if dist is not None else int(os.environ.get("RANK", "0"))
