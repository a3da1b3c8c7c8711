"""Time from a fault to the whole job running again: ft_launcher next to torchrun.

2 local launchers x 2 gloo workers (`bench/worker.py`), `--rdzv-backend=c10d`,
`--max-restarts=3`, a fresh port and temporary directory per run. Rank 1 faults once at step K:

- crash: `os._exit(1)`, for ft_launcher (with and without its fork server) and
  torchrun (as it comes, and with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, without which torch
  2.13's torchrun cannot restart gloo workers: see common.TORCHRUN_NO_SHARE);
- hang: stops heartbeating, for ft_launcher with `--ft-rank-heartbeat-timeout=2`
  (torchrun has no hang detection).

Series run interleaved, run by run, so that load changes on the machine hit all of them.

Two figures per run, both from the fault's timestamp: "started" = the last of the 4 new worker
processes began running the script; "stepping" = the last of the 4 ranks finished its first step.
Prints median (min-max) over the runs, the ft/torchrun ratio and the targets.
"""

from __future__ import annotations

import argparse
import dataclasses

from common import (
    FT,
    FT_NO_PREWARM,
    TORCHRUN,
    TORCHRUN_NO_SHARE,
    Launcher,
    Recovery,
    Stats,
    become_subreaper,
    fault_run,
    load_average,
    machine_line,
    progress,
    table,
)
from common import ratio as median_ratio

HEARTBEAT_TIMEOUT_S = 2.0
CRASH_TARGET_S, CRASH_RATIO_TARGET = 3.0, 0.5
HANG_TARGET_S = HEARTBEAT_TIMEOUT_S + 1.5


@dataclasses.dataclass
class Series:
    launcher: Launcher
    scenario: str
    runs: list[Recovery] = dataclasses.field(default_factory=list)

    def stats(self, field: str) -> Stats | None:
        return Stats.of([getattr(r, field) for r in self.runs])

    @property
    def failures(self) -> list[str]:
        return [r.note for r in self.runs if not r.ok]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per launcher and scenario")
    parser.add_argument("--fault-step", type=int, default=150, help="step at which rank 1 faults")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parser.parse_args()


def measure(runs: int, fault_step: int) -> list[Series]:
    """Run every series `runs` times, interleaved so that load changes hit all of them."""
    plan = [
        Series(FT, "crash"),
        Series(FT_NO_PREWARM, "crash"),
        Series(TORCHRUN, "crash"),
        Series(TORCHRUN_NO_SHARE, "crash"),
        Series(FT, "hang"),
    ]
    for i in range(runs):
        for series in plan:
            progress(f"run {i + 1}/{runs}: {series.launcher.name} {series.scenario}")
            result = fault_run(series.launcher, series.scenario, fault_step)
            series.runs.append(result)
            progress(f"  -> started {_fmt(result.to_started)}  stepping {_fmt(result.to_stepping)}")
    return plan


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def is_torchrun(series: Series) -> bool:
    return series.launcher.argv == TORCHRUN.argv


def best_torchrun(plan: list[Series]) -> Series | None:
    """The fastest torchrun setting that recovered: the fair baseline for the ratios."""
    recovered = [s for s in plan if is_torchrun(s) and s.stats("to_stepping") is not None]
    return min(recovered, key=lambda s: s.stats("to_stepping").median, default=None)


def target_cell(series: Series, baseline: Series | None) -> str:
    """The target of a series and whether its median meets it."""
    stepping = series.stats("to_stepping")
    if is_torchrun(series):
        return "reference"
    if series.scenario == "hang":
        meets = stepping is not None and stepping.median <= HANG_TARGET_S
        return _verdict(f"<= {HANG_TARGET_S:.1f} s", meets)
    rel = median_ratio(stepping, baseline.stats("to_stepping") if baseline else None)
    meets = stepping is not None and stepping.median <= CRASH_TARGET_S
    meets_rel = rel is None or rel <= CRASH_RATIO_TARGET  # no torchrun figure: absolute only
    target = f"<= {CRASH_TARGET_S:.0f} s, <= {CRASH_RATIO_TARGET}x torchrun"
    return _verdict(target, meets and meets_rel)


def _verdict(target: str, ok: bool) -> str:
    return f"{target}: {'yes' if ok else 'NO'}"


def ratio_cell(series: Series, baseline: Series | None) -> str:
    if is_torchrun(series) or series.scenario != "crash" or baseline is None:
        return ""
    parts = []
    for field, label in (("to_started", "started"), ("to_stepping", "stepping")):
        value = median_ratio(series.stats(field), baseline.stats(field))
        parts.append(f"{label} {'-' if value is None else f'{value:.2f}'}")
    return ", ".join(parts)


def render(plan: list[Series], markdown: bool) -> str:
    baseline = best_torchrun(plan)
    headers = ["launcher", "scenario", "recovered", "to started s", "to stepping s"]
    headers += ["ft/torchrun", "target"]
    rows = []
    for series in plan:
        started, stepping = series.stats("to_started"), series.stats("to_stepping")
        rows.append(
            [
                series.launcher.name,
                series.scenario,
                f"{len(series.runs) - len(series.failures)}/{len(series.runs)}",
                started.cell() if started else "-",
                stepping.cell() if stepping else "no recovery",
                ratio_cell(series, baseline),
                target_cell(series, baseline),
            ]
        )
    note = "median (min-max) seconds from the fault; ratios of medians against "
    note += baseline.launcher.name if baseline else "no torchrun (none recovered)"
    return table(headers, rows, markdown) + "\n\n" + note


def failure_notes(plan: list[Series]) -> str:
    """The first failure of each series in full, and how many more there were."""
    notes = []
    for series in plan:
        if series.failures:
            head = f"{series.launcher.name} {series.scenario}, {len(series.failures)} of "
            head += f"{len(series.runs)} runs failed; the first: "
            notes.append(head + series.failures[0])
    return "\n\n".join(notes)


def main() -> None:
    args = parse_args()
    become_subreaper()
    load = load_average()
    plan = measure(args.runs, args.fault_step)
    print(render(plan, args.markdown))
    print(f"\n{machine_line(load)}; {args.runs} run(s) per row")
    notes = failure_notes(plan)
    if notes:
        print("\nRuns that did not recover:\n" + notes)


if __name__ == "__main__":
    main()
