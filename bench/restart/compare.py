"""Side by side, as a user would run them: ft_launcher, torchrun and NVRx's ft_launcher.

Every launcher runs the same plain training script, `bench/workers/user_worker.py`: a tiny DDP
model on gloo (`--model allreduce`: an all_reduce of a small tensor instead), a 0.05 s sleep per
step, a checkpoint every 100 steps, RankMonitorClient sections and heartbeats under the two
fault-tolerant launchers, no client under torchrun; errors propagate and the interpreter tears
down normally (none of the example's `os._exit` habit). 2 local launchers x 2 workers,
`--rdzv-backend=c10d --max-restarts=3`, a fresh port and directory per job; ft_launcher and NVRx
get `--ft-rank-section-timeouts=step:60` (NVRx refuses sections it was not told of) and, for the
hang, `--ft-rank-heartbeat-timeout=2`. Scenarios, each a fresh job:

- startup: launch -> every rank has finished its first step (taken from the early job);
- early: rank 1 raises at step `--early-step` (5), right after start-up, before what a
  launcher prepares for restarts could be warm -> every rank has finished a step in a new process;
- late: rank 1 raises after `--late-after` (30) s of training, once whatever a launcher keeps
  ready is ready; before the fault, each node's memory is sampled: PSS (shared pages counted
  once) of the launcher and all its descendants, split into the workers and the rest ("what the
  launcher keeps ready": its fork server, monitors), and the CPU of the rest;
- hang: rank 1 sleeps inside its step section after `--late-after` s (launchers with hang
  detection only; torchrun has none).

Launchers: ft (ft_launcher, defaults), torchrun-noshare (torchrun with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which torch 2.13's torchrun needs to restart gloo workers
at all: see common.jobs.TORCHRUN_NO_SHARE), torchrun (as it comes; recorded as "did not recover"
when it does not), nvrx (NVRx's ft_launcher from bench/.nvrx-venv, see RESULTS.md). Runs are
interleaved: run 1 of every scenario and launcher, then run 2, ... Ratios are pair by pair (ft
run i over the peer's run i, median of the ratios). The floor, `python -c "import torch"`, is
timed once per run in the same session. Raw results go to bench/out/compare-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.common import OUT, smoke
from bench.common.jobs import (
    FT,
    NVRX,
    NVRX_BIN,
    SECTION_ARGS,
    TORCHRUN,
    TORCHRUN_NO_SHARE,
    USER_WORKER,
    WORLD,
    Job,
    Launcher,
    import_torch_s,
    job,
    take_charge,
)
from bench.common.logs import read_steps, user_all_stepping, user_fault, user_pids
from bench.common.report import load_average, machine_line, pair_ratios, progress, ratio_cell, table
from bench.common.timing import Stopwatch

SCENARIOS = ("startup", "early", "late", "hang")
STARTUP_WAIT_S = 180.0
STEP_S = 0.05  # user_worker.py's default --step-sleep
SAMPLE_EVERY_S = 2.0
MB = 2**20

# Acceptance (issue 13): ratios are medians of pair-by-pair ratios.
EARLY_RATIO_TARGET = 0.5  # early crash: <= 0.5x the faster of torchrun-noshare and NVRx
LATE_TARGET_S = 1.0
HANG_TARGET_S = 2.8
STARTUP_RATIO_TARGET = 0.9  # start-up: <= 0.9x torchrun (no shared store)


@dataclasses.dataclass(frozen=True)
class Contender:
    """A launcher setting in this bench: its key on the command line, its column, its client."""

    key: str
    label: str
    launcher: Launcher
    client: str  # user_worker.py --client

    @property
    def detects_hangs(self) -> bool:
        return self.launcher.hang_args is not None


CONTENDERS = {
    c.key: c
    for c in (
        Contender("ft", "ft_launcher", dataclasses.replace(FT, args=SECTION_ARGS), "ftrun"),
        Contender("torchrun-noshare", "torchrun, no shared store", TORCHRUN_NO_SHARE, "none"),
        Contender("torchrun", "torchrun as it comes", TORCHRUN, "none"),
        Contender("nvrx", "NVRx", dataclasses.replace(NVRX, args=SECTION_ARGS), "nvrx"),
    )
}
BASELINE = "torchrun-noshare"  # the torchrun of the start-up target


@dataclasses.dataclass
class Outcome:
    """One job: one launcher, one scenario, one run."""

    contender: str
    scenario: str
    run: int
    startup_s: float | None = None
    recovery_s: float | None = None  # fault -> every rank finished a step in a new process
    fault_ts: float | None = None
    note: str = ""
    exit_codes: list[int | None] = dataclasses.field(default_factory=list)
    memory: dict[str, float] | None = None
    ft_events: list[dict[str, Any]] | None = None
    kept_dir: str | None = None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="interleaved runs (default 5)")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        default=list(SCENARIOS),
        metavar="S",
        help=f"of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument(
        "--launchers",
        nargs="+",
        choices=list(CONTENDERS),
        default=list(CONTENDERS),
        metavar="L",
        help=f"of {', '.join(CONTENDERS)} (default: all; ft is required)",
    )
    parser.add_argument(
        "--model", choices=["ddp", "allreduce"], default="ddp", help="user_worker.py --model"
    )
    parser.add_argument("--early-step", type=int, default=5, help="step of the early crash")
    parser.add_argument(
        "--late-after", type=float, default=30.0, help="s of training before the late faults"
    )
    parser.add_argument(
        "--recovery-timeout", type=float, default=60.0, help="s to wait for all ranks stepping"
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", type=Path, help="raw results (default bench/out/compare-*.json)")
    # the smoke: start-up and an early crash, ftrun and torchrun (NVRx where installed)
    sizes = {"runs": 1, "scenarios": ["early"], "launchers": ["ft", "torchrun-noshare", "nvrx"],
             "early_step": 3}  # fmt: skip
    args = smoke.parse_args(parser, sizes)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if "ft" not in args.launchers:
        parser.error("--launchers must include ft (the ratios are ft's)")
    return args


# ---- one job ------------------------------------------------------------------------------------


def worker_args(contender: Contender, model: str, fault: str, step: int, after: float) -> list[str]:
    # Enough steps (0.05 s each at least) for the scenario; should the bench die, jobs end soon.
    steps = int((after + 120.0) / STEP_S)
    args = ["--client", contender.client, "--model", model, "--steps", str(steps)]
    if fault != "none":
        args += ["--fault", fault, "--fault-step", str(step), "--fault-after", str(after)]
    return args


def run_job(contender: Contender, scenario: str, run: int, args: argparse.Namespace) -> Outcome:
    """Start the job of `scenario`, time start-up and the recovery, sample memory (late)."""
    outcome = Outcome(contender.key, scenario, run)
    fault = {"startup": "none", "early": "crash", "late": "crash", "hang": "hang"}[scenario]
    step = args.early_step if scenario == "early" else 0
    after = args.late_after if scenario in {"late", "hang"} else 0.0
    extra = (contender.launcher.hang_args or ()) if scenario == "hang" else ()
    script_args = worker_args(contender, args.model, fault, step, after)
    with job(contender.launcher, extra, script_args, USER_WORKER) as run_:
        stepping = run_.wait(lambda: user_all_stepping(run_.out), STARTUP_WAIT_S)
        if stepping is None:
            outcome.note = f"start-up failed within {STARTUP_WAIT_S:.0f}s; {describe(run_)}"
        else:
            outcome.startup_s = stepping - run_.launched_at
            if scenario == "late":
                outcome.memory = sample_footprint(run_, stepping + args.late_after - 2.0)
            if fault != "none":
                await_recovery(run_, args, outcome)
        outcome.exit_codes = run_.exit_codes()
        if contender.key == "ft":
            outcome.ft_events = ft_events(run_)
        if outcome.note:  # keep what a failed run left, for a look
            outcome.kept_dir = str(run_.tmp)
            run_.keep = True
    return outcome


def await_recovery(run_: Job, args: argparse.Namespace, outcome: Outcome) -> None:
    wait_s = args.late_after + STARTUP_WAIT_S
    fault = run_.wait(lambda: user_fault(run_.out), wait_s)
    if fault is None:
        outcome.note = f"no fault within {wait_s:.0f}s; {describe(run_)}"
        return
    outcome.fault_ts = fault.ts
    old = frozenset(user_pids(run_.out, until=fault.ts) | {fault.pid})
    stepping = run_.wait(lambda: user_all_stepping(run_.out, fault.ts, old), args.recovery_timeout)
    if stepping is None:
        if run_.running():
            said = f"did not recover within {args.recovery_timeout:.0f}s of the fault"
        else:
            said = f"did not recover: the launchers gave up {time.time() - fault.ts:.0f}s after"
        outcome.note = f"{said}; {describe(run_, fault.ts, old)}"
        return
    outcome.recovery_s = stepping - fault.ts


def describe(run_: Job, since: float | None = None, old: frozenset[int] = frozenset()) -> str:
    """What the launchers did, and after a fault the workers started since, for a run that did
    not reach its goal."""
    if since is None:
        return run_.describe()
    new = [
        len({r.pid for r in read_steps(run_.out, rank) if r.ts > since} - old)
        for rank in range(WORLD)
    ]
    return run_.describe(f"new processes that logged a step after the fault, per rank: {new}")


def ft_events(run_: Job) -> list[dict[str, Any]]:
    """ft_launcher's events (both nodes), for looking at where its time went."""
    events = []
    for path in sorted((run_.tmp / "logs").glob("events-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return sorted(events, key=lambda e: float(e.get("ts", 0)))


# ---- memory ------------------------------------------------------------------------------------


def _pss(proc: psutil.Process) -> int:
    try:
        return proc.memory_full_info().pss
    except psutil.Error:
        return 0


def _cpu_s(proc: psutil.Process) -> float | None:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def node_split(
    agent: psutil.Process, workers: set[int]
) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """The launcher's descendants: (launcher + what it keeps ready, workers and theirs)."""
    try:
        tree = agent.children(recursive=True)
    except psutil.Error:
        return [agent], []
    working: set[int] = set()
    for proc in tree:
        if proc.pid in workers:
            working.add(proc.pid)
            with contextlib.suppress(psutil.Error):
                working.update(p.pid for p in proc.children(recursive=True))
    return [agent, *(p for p in tree if p.pid not in working)], [
        p for p in tree if p.pid in working
    ]


def _live(pids: set[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    return procs


def sample_footprint(run_: Job, until: float) -> dict[str, float] | None:
    """PSS per node (mean of the nodes, largest sample) until wall time `until`; CPU % meanwhile.

    Sampling starts halfway to `until`, so that what a launcher starts after the first steps
    (ft_launcher's prewarmed workers or fork server) is there."""
    start = time.time() + max(0.0, (until - time.time()) / 2)
    time.sleep(max(0.0, start - time.time()))
    agents = [psutil.Process(p.pid) for p in run_.procs]
    ready_mb, node_mb, first_cpu = [], [], None
    watch = Stopwatch()
    while True:
        workers = user_pids(run_.out)
        splits = [node_split(agent, workers) for agent in agents]
        ready = [sum(map(_pss, helpers)) for helpers, _ in splits]
        ready_mb.append(statistics.mean(ready) / MB)
        # The workers wherever they sit in the process tree (a fork server's children too).
        working = _live({p.pid for _, w in splits for p in w} | workers)
        node_mb.append(ready_mb[-1] + sum(map(_pss, working)) / len(agents) / MB)
        if first_cpu is None:
            first_cpu = {p.pid: (p, _cpu_s(p)) for helpers, _ in splits for p in helpers}
        if time.time() + SAMPLE_EVERY_S > until or not run_.running():
            break
        time.sleep(SAMPLE_EVERY_S)
    elapsed = watch.seconds()
    cpu = 0.0
    for proc, before in first_cpu.values():
        after = _cpu_s(proc)
        if before is not None and after is not None:
            cpu += after - before
    return {
        "launcher_and_ready_pss_mb": max(ready_mb),
        "node_pss_mb": max(node_mb),
        "launcher_and_ready_cpu_pct": 100.0 * cpu / len(agents) / elapsed if elapsed else 0.0,
        "samples": len(ready_mb),
        "window_s": elapsed,
    }


# ---- the plan -----------------------------------------------------------------------------------


def job_scenarios(scenarios: Sequence[str]) -> list[str]:
    """The jobs to run: start-up is timed in the early job when there is one."""
    jobs = [s for s in SCENARIOS if s in scenarios and s != "startup"]
    if "startup" in scenarios and "early" not in scenarios:
        jobs.insert(0, "startup")
    return jobs


def measure(args: argparse.Namespace) -> tuple[list[Outcome], list[float]]:
    chosen = [CONTENDERS[k] for k in args.launchers]
    outcomes, floor = [], []
    for run in range(args.runs):
        progress(f"run {run + 1}/{args.runs}")
        floor.append(import_torch_s())
        progress(f"  floor: import torch {floor[-1]:.2f}s")
        for scenario in job_scenarios(args.scenarios):
            for contender in chosen:
                if scenario == "hang" and not contender.detects_hangs:
                    continue
                outcome = run_job(contender, scenario, run, args)
                outcomes.append(outcome)
                progress(f"  {scenario:7} {contender.key:16} {_brief(outcome)}")
    return outcomes, floor


def _brief(outcome: Outcome) -> str:
    parts = [f"start-up {_fmt(outcome.startup_s)}"]
    if outcome.scenario != "startup":
        parts.append(f"recovery {_fmt(outcome.recovery_s)}")
    if outcome.memory:
        parts.append(f"PSS ready {outcome.memory['launcher_and_ready_pss_mb']:.0f} MB")
    if outcome.note:
        parts.append(outcome.note.splitlines()[0][:160])
    return ", ".join(parts)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


# ---- the table ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Metric:
    label: str
    scenario: str  # the jobs it is read from
    value: Callable[[Outcome], float | None]
    kind: str = "recovery"  # recovery | startup | memory | cpu
    fmt: str = "{:.2f}"


def _memory(key: str) -> Callable[[Outcome], float | None]:
    return lambda o: None if o.memory is None else o.memory[key]


METRICS = [
    Metric(
        "start-up: launch -> all ranks stepping (s)", "startup", lambda o: o.startup_s, "startup"
    ),
    Metric("early crash -> all ranks stepping (s)", "early", lambda o: o.recovery_s),
    Metric("late crash -> all ranks stepping (s)", "late", lambda o: o.recovery_s),
    Metric("hang (2 s timeout) -> all ranks stepping (s)", "hang", lambda o: o.recovery_s),
    Metric(
        "PSS per node, launcher + what it keeps ready (MB)",
        "late",
        _memory("launcher_and_ready_pss_mb"),
        "memory",
        "{:.0f}",
    ),
    Metric(
        "PSS per node, with the workers (MB)", "late", _memory("node_pss_mb"), "memory", "{:.0f}"
    ),
    Metric(
        "CPU per node, launcher + what it keeps ready (% of a core)",
        "late",
        _memory("launcher_and_ready_cpu_pct"),
        "cpu",
        "{:.1f}",
    ),
]


def series(outcomes: Sequence[Outcome], key: str, metric: Metric) -> dict[int, float | None]:
    """Run number -> value, for one launcher and metric (startup comes from the early jobs)."""
    scenario = metric.scenario
    if scenario == "startup" and any(o.scenario == "early" for o in outcomes):
        scenario = "early"
    return {
        o.run: metric.value(o) for o in outcomes if o.contender == key and o.scenario == scenario
    }


def cell(values: dict[int, float | None], fmt: str, timeout: float | None) -> str:
    clean = [v for v in values.values() if v is not None]
    if not values:
        return "not run"
    if not clean:
        return f"did not recover within {timeout:.0f} s (0/{len(values)})" if timeout else "-"
    text = fmt.format(statistics.median(clean))
    if len(clean) > 1:
        text += f" ({fmt.format(min(clean))}-{fmt.format(max(clean))})"
    if len(clean) < len(values):
        text += f", {len(clean)}/{len(values)} recovered"
    return text


def target_cell(metric: Metric, data: dict[str, dict[int, float | None]]) -> str:
    """Issue 13's target for the metric, and whether ft_launcher's figures meet it."""
    ours = data.get("ft", {})
    clean = [v for v in ours.values() if v is not None]
    if metric.kind == "memory":
        return "reported"
    if not clean or metric.kind == "cpu":
        return ""
    if metric.scenario == "startup":
        ratios = pair_ratios(ours, data.get(BASELINE, {}))
        target = f"<= {STARTUP_RATIO_TARGET}x {CONTENDERS[BASELINE].label}"
        if not ratios:
            return f"{target}: no figure of it"
        median = statistics.median(ratios)
        return _ok(f"{target} ({median:.2f})", median <= STARTUP_RATIO_TARGET)
    if metric.scenario == "early":
        best = {
            run: min(
                (data[k][run] for k in ("torchrun-noshare", "nvrx") if data.get(k, {}).get(run)),
                default=None,
            )
            for run in ours
        }
        ratios = pair_ratios(ours, best)
        target = f"<= {EARLY_RATIO_TARGET}x the faster of torchrun (no shared store) and NVRx"
        if not ratios:
            return f"{target}: neither recovered"
        median = statistics.median(ratios)
        return _ok(f"{target} ({median:.2f})", median <= EARLY_RATIO_TARGET)
    limit = {"late": LATE_TARGET_S, "hang": HANG_TARGET_S}[metric.scenario]
    return _ok(f"<= {limit:.1f} s", statistics.median(clean) <= limit)


def _ok(target: str, ok: bool) -> str:
    return f"{target}: {'yes' if ok else 'NO'}"


def render(outcomes: Sequence[Outcome], floor: Sequence[float], args: argparse.Namespace) -> str:
    keys = [k for k in args.launchers if any(o.contender == k for o in outcomes)]
    peers = [k for k in keys if k != "ft"]
    headers = ["metric", *(CONTENDERS[k].label for k in keys)]
    headers += [f"ft/{CONTENDERS[k].label}" for k in peers]
    headers += ["floor (import torch)", "target"]
    floor_cell = f"{statistics.median(floor):.2f}" if floor else "-"
    rows = []
    for metric in METRICS:
        data = {k: series(outcomes, k, metric) for k in keys}
        if not any(data.values()):
            continue
        timeout = args.recovery_timeout if metric.kind == "recovery" else None
        row = [metric.label]
        row += [
            "no hang detection"
            if metric.scenario == "hang" and not CONTENDERS[k].detects_hangs
            else cell(data[k], metric.fmt, timeout)
            for k in keys
        ]
        row += [ratio_cell(pair_ratios(data["ft"], data[k])) for k in peers]
        cold = metric.kind == "startup" or (
            metric.kind == "recovery" and metric.scenario in {"early", "late"}
        )
        row += [floor_cell if cold else "", target_cell(metric, data)]
        rows.append(row)
    return table(headers, rows, args.markdown)


FT_PHASES = ("fault -> detected", "-> new workers started", "-> all ranks stepping")


def ft_phases(outcome: Outcome) -> tuple[float, float, float] | None:
    """Where ft_launcher's recovery time went, from its events: the fault to the first verdict
    (a worker's exit or a hang), to the last node's `workers_started`, to every rank stepping."""
    if outcome.fault_ts is None or outcome.recovery_s is None or not outcome.ft_events:
        return None
    after = [e for e in outcome.ft_events if float(e["ts"]) >= outcome.fault_ts]
    detected = next((e for e in after if e["event"] in {"worker_exited", "hang"}), None)
    if detected is None:
        return None
    started = [
        float(e["ts"])
        for e in after
        if e["event"] == "workers_started" and e["cycle"] != detected["cycle"]
    ]
    if not started:
        return None
    t_detected = float(detected["ts"]) - outcome.fault_ts
    t_started = max(started) - outcome.fault_ts
    return t_detected, t_started - t_detected, outcome.recovery_s - t_started


def ft_breakdown(outcomes: Sequence[Outcome], markdown: bool) -> str:
    """Median of each phase of ft_launcher's recoveries, per scenario."""
    rows = []
    for scenario in ("early", "late", "hang"):
        phases = [
            p
            for o in outcomes
            if o.contender == "ft" and o.scenario == scenario and (p := ft_phases(o))
        ]
        if phases:
            medians = [statistics.median(p[i] for p in phases) for i in range(3)]
            rows.append([scenario, *(f"{m:.2f}" for m in medians), str(len(phases))])
    if not rows:
        return ""
    return table(["ft_launcher recovery (median s)", *FT_PHASES, "runs"], rows, markdown)


def failures(outcomes: Sequence[Outcome]) -> str:
    """The first failed run of each launcher and scenario, with what its launchers said."""
    notes, seen = [], set()
    for o in outcomes:
        if o.note and (o.contender, o.scenario) not in seen:
            seen.add((o.contender, o.scenario))
            count = sum(
                1
                for p in outcomes
                if (p.contender, p.scenario) == (o.contender, o.scenario) and p.note
            )
            notes.append(
                f"{CONTENDERS[o.contender].label}, {o.scenario}: {count} run(s); "
                f"run {o.run + 1} (its files: {o.kept_dir}): {o.note}"
            )
    return "\n\n".join(notes)


def nvrx_version() -> str:
    proc = subprocess.run(
        [
            str(NVRX_BIN / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('nvidia-resiliency-ext'))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() or "?"


def write_json(path: Path, outcomes: Sequence[Outcome], floor: Sequence[float], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = {
        **meta,
        "floor_import_torch_s": list(floor),
        "jobs": [dataclasses.asdict(o) for o in outcomes],
    }
    path.write_text(json.dumps(raw, indent=1, default=str))


def main() -> None:
    args = parse_args()
    if "nvrx" in args.launchers:
        if NVRX.available:
            CONTENDERS["nvrx"] = dataclasses.replace(
                CONTENDERS["nvrx"], label=f"NVRx {nvrx_version()}"
            )
        else:
            progress(f"NVRx not installed ({NVRX.argv[0]} missing): left out (see RESULTS.md)")
            args.launchers.remove("nvrx")
    take_charge()
    load = load_average()
    started = time.strftime("%Y%m%d-%H%M%S")
    outcomes, floor = measure(args)
    print(render(outcomes, floor, args))
    print(
        "\nmedian (min-max) over runs; ratios: median (min-max) of ft run i / peer run i; "
        f"floor: median of {len(floor)} `python -c 'import torch'`; user_worker.py --model "
        f"{args.model}; early crash at step "
        f"{args.early_step}, late faults after {args.late_after:.0f} s of training; PSS and CPU: "
        "mean of the 2 nodes, largest of the samples taken before the late crash"
    )
    print(f"{machine_line(load)}; {args.runs} run(s)")
    breakdown = ft_breakdown(outcomes, args.markdown)
    if breakdown:
        print("\n" + breakdown)
    notes = failures(outcomes)
    if notes:
        print("\nRuns that did not reach their goal:\n" + notes)
    path = args.json or OUT / f"compare-{started}.json"
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_line(load)}
    write_json(path, outcomes, floor, meta)
    progress(f"raw results: {path}")


if __name__ == "__main__":
    main()
