"""GPUs, one plain training script, three launchers: ft_launcher, torchrun and NVRx 0.7.0.

Every job runs `bench/workers/gpu_user_worker.py` (151M transformer, AdamW, DDP over NCCL,
`torch.save` every `--ckpt-every` steps, no client of any launcher) in a fresh directory, laid
out as `--layouts` says (`bench/common/layouts.py`): `N`, one launcher with `--standalone
--nproc-per-node=N --max-restarts=3` (a fresh store port per job, chosen by the launcher); `AxB`,
A launchers on this host as A nodes, B GPUs each (their own CUDA_VISIBLE_DEVICES), over c10d on
127.0.0.1. Rank 0 crashes once at `--early` (5) and once at `--late` (35); a restart's figures
are its slowest rank's. The job trains on to `--steps` (late + 10) from the checkpoint. A job
counts when its launchers exit 0 and the last step was reached; otherwise it is recorded as
failed, with the tail of its output. Jobs are interleaved (run 1 of every layout, setting,
variant and launcher, then run 2, ...), and the launcher that goes first rotates run to run.

Contenders: `ftrun` (`python -m ftrun.ft_launcher.cli`, which works from PYTHONPATH=src without
console scripts), `torchrun` (`python -m torch.distributed.run`), `nvrx` (NVRx's launcher
`main`, with NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1; left out when it does not import). ftrun and
NVRx get `--ft-rank-section-timeouts=step:60`, as in compare.py. Settings: `omp-unset`
(OMP_NUM_THREADS removed) and `omp1` (OMP_NUM_THREADS=1). Variants: `plain` and `compile`
(worker `--compile`) and `compile-warm` (the same, each measured job after an unmeasured one of
the same launcher with the same TMPDIR: a user's second job, its caches where torch keeps them);
the compile variants add `ftrun-nocache`: ftrun with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, a
restart of a compiled model without warm caches. torchrun runs with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, its restart of several ranks hangs.

Caches: every job starts cold. Each job has its own TMPDIR (where inductor's default cache
lives, which ftrun's workers use) and torchrun and NVRx get fresh TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR in the job's directory (triton's default is ~/.triton, shared by every job).
Within a job, a restart of any launcher may reuse what its earlier cycles wrote: that is what a
user gets from torch's caches. ftrun gets no cache variables: torch's default, in the job's TMPDIR.

Measures, from the wall-clock times in rank 0's log and the launch time: startup (launch ->
first step), early and late (crash -> first step of the next process), and for each restart the
split, cumulative from the crash: process start (`proc=`, or the script's first line), CUDA
model built, process group up, ready to train. Ratios are pair by pair (run i over run i,
median of the ratios). Raw results: `--out-dir`/gpu-compare-<time>.json. Runs split over
several calls merge with `--from-json` (give each call its own `--first-run`, or the same one
with disjoint `--launchers`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

from bench.common import OUT, WORKERS, smoke
from bench.common.gpu_host import PY, cuda_in_child, machine_line, nvrx_importable
from bench.common.harness import free_port
from bench.common.jobs import SECTION_ARGS, TAG_ENV, Job, Launcher, kill_everything, take_charge
from bench.common.layouts import Layout
from bench.common.report import Stats, pair_ratios, progress, ratio_cell, table
from bench.restart.gpu_lives import MARKS, measures, read_lives

WORKER = WORKERS / "gpu_user_worker.py"
NVRX_MAIN = "from nvidia_resiliency_ext.fault_tolerance.launcher import main; main()"
SMALL_MODEL = ("--d-model", "128", "--layers", "2", "--batch", "2", "--seq", "64")
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")
SETTINGS = {"omp-unset": None, "omp1": "1"}  # -> OMP_NUM_THREADS (None: removed)
VARIANTS = ("plain", "compile", "compile-warm")
STARTUP_TARGET = 1.0  # ftrun/torchrun, median of pair ratios
# Early and late restarts, ftrun/torchrun.
RECOVERY_TARGET = {"plain": 0.25, "compile": 0.3, "compile-warm": 0.3}
WIDTH_TARGET = 1.2  # ftrun at any layout / ftrun at 1 GPU, early and late


@dataclasses.dataclass(frozen=True)
class Contender:
    """A launcher in this bench; `fresh_caches`: the bench gives it per-job compile caches."""

    key: str
    launcher: Launcher
    fresh_caches: bool = False
    compile_only: bool = False


FTRUN = Launcher("ftrun", (PY, "-m", "ftrun.ft_launcher.cli"), None, SECTION_ARGS)
FTRUN_NOCACHE = dataclasses.replace(
    FTRUN, name="ftrun-nocache", env=(("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1"),)
)
# torchrun's in-job restart of several gloo or NCCL ranks hangs in the first collective (the
# restarted ranks share the first attempt's store keys): torch's own opt-out (pytorch#135712).
NO_SHARE = (("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),)
TORCHRUN = Launcher("torchrun", (PY, "-m", "torch.distributed.run"), None, (), NO_SHARE)
NVRX = Launcher(
    "NVRx",
    (PY, "-c", NVRX_MAIN),
    None,
    SECTION_ARGS,
    (("NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE", "1"),),
)
CONTENDERS = {
    c.key: c
    for c in (
        Contender("ftrun", FTRUN),
        Contender("ftrun-nocache", FTRUN_NOCACHE, compile_only=True),
        Contender("torchrun", TORCHRUN, fresh_caches=True),
        Contender("nvrx", NVRX, fresh_caches=True),
    )
}
# (ours, peer) columns of pair-by-pair ratios, where both ran.
RATIOS = (("ftrun", "torchrun"), ("ftrun", "nvrx"), ("ftrun-nocache", "torchrun"))


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What one job runs, but for the launcher: setting, variant, layout."""

    setting: str
    variant: str
    layout: Layout


@dataclasses.dataclass
class Outcome:
    """One job: one launcher in one setting and variant, one run."""

    setting: str
    variant: str
    contender: str
    run: int
    layout: str = "1"
    ok: bool = False
    rc: int | None = None
    wall_s: float = 0.0
    measures: dict[str, float | None] = dataclasses.field(default_factory=dict)
    note: str = ""
    tail: str = ""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs (default 3)")
    parser.add_argument("--first-run", type=int, default=0, help="number of the first run")
    for flag, choices in (
        ("settings", SETTINGS),
        ("variants", VARIANTS),
        ("launchers", CONTENDERS),
    ):
        parser.add_argument(
            f"--{flag}",
            type=_subset(choices),
            default=list(choices),
            help=f"comma-separated, of {','.join(choices)} (default: all)",
        )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a small model, gloo"
    )
    parser.add_argument("--layouts", type=_layouts, default=[Layout(1, 1)],
                        help="comma-separated: N (one launcher, N GPUs) or AxB (A launchers x "
                             "B GPUs each, on this host); default 1")  # fmt: skip
    parser.add_argument("--early", type=int, default=5, help="step of the early crash")
    parser.add_argument("--late", type=int, default=35, help="step of the late crash")
    parser.add_argument("--steps", type=int, help="steps in all (default: late + 10)")
    parser.add_argument("--job-timeout", type=float, default=240.0, help="s per job")
    parser.add_argument("--out-dir", type=Path, default=OUT, help="raw results")
    parser.add_argument("--json", type=Path, help="default: OUT_DIR/gpu-compare-<time>.json")
    parser.add_argument("--from-json", type=Path, nargs="+", help="tabulate these; run nothing")
    parser.add_argument("--markdown", action="store_true", help="markdown tables")
    parser.add_argument("--check", action="store_true", help="PASS/FAIL against the targets")
    # the smoke: one job of each launcher, plain, on the GPU, or the CPU path where none is
    sizes = {"runs": 1, "settings": ["omp1"], "variants": ["plain"], "early": 2, "late": 4,
             "steps": 6, "job_timeout": 120.0}  # fmt: skip
    args = smoke.parse_args(parser, sizes, argv)
    if args.smoke and not args.from_json and not cuda_in_child():
        args.device = "cpu"
        smoke.skip_gpu("gpu_compare", "the GPU jobs (its CPU path, --device cpu, runs instead)")
    args.steps = args.steps or args.late + 10
    if args.runs < 1 or not 0 < args.early < args.late < args.steps:
        parser.error("need --runs >= 1 and 0 < --early < --late < --steps")
    return args


def _layouts(text: str) -> list[Layout]:
    try:
        return [Layout.parse(part) for part in text.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _subset(choices: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of `choices`, in the order given."""

    def parse(text: str) -> list[str]:
        picked = [p for p in text.split(",") if p]
        unknown = [p for p in picked if p not in choices]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}")
        return picked

    return parse


# ---- one job -------------------------------------------------------------------------------------


def job_env(contender: Contender, setting: str, variant: str, tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    env.pop("VIRTUAL_ENV", None)
    env.pop("OMP_NUM_THREADS", None)
    if SETTINGS[setting] is not None:
        env["OMP_NUM_THREADS"] = SETTINGS[setting]
    if contender.fresh_caches and variant != "compile-warm":
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmpdir.parent / "cache" / "inductor")
        env["TRITON_CACHE_DIR"] = str(tmpdir.parent / "cache" / "triton")
    # What a launcher or torch leaves in the temporary directory stays with the job (with
    # compile-warm: with the contender's two jobs, whose caches live there, torch's default).
    env.update(dict(contender.launcher.env), TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1")
    return env


def worker_args(args: argparse.Namespace, variant: str, tmp: Path) -> list[str]:
    argv = [str(WORKER), "--out", str(tmp / "out"), "--ckpt-dir", str(tmp / "ckpt")]
    argv += ["--crash-at-step", str(args.early), "--crash-at-step", str(args.late)]
    argv += ["--ckpt-every", "10", "--steps", str(args.steps), "--device", args.device]
    if args.device == "cpu":
        argv += SMALL_MODEL
    return [*argv, "--compile"] if variant.startswith("compile") else argv


def start(contender: Contender, how: JobPlan, args: argparse.Namespace, tmpdir: Path | None) -> Job:
    """The job's launchers (one per node of the layout), in a fresh directory; their TMPDIR
    the job's own, or `tmpdir` (compile-warm: shared by a contender's two jobs)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"ftrun-gpu-{contender.key}-"))
    if tmpdir is None:
        tmpdir = tmp / "tmp"
        tmpdir.mkdir()
    layout, port = how.layout, free_port()
    argv = [*contender.launcher.argv, *layout.launcher_args(port, tmp.name)]
    argv += [*contender.launcher.args, *worker_args(args, how.variant, tmp)]
    env = {**job_env(contender, how.setting, how.variant, tmpdir), TAG_ENV: str(tmp)}
    procs = []
    launched_at = time.time()
    for node in range(layout.nodes):
        with (tmp / f"launcher{node}.log").open("wb") as log:
            procs.append(subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True,
                env={**env, **layout.node_env(node, args.device, os.environ)},
            ))  # fmt: skip
    return Job(contender.launcher, tmp, tmp / "out", procs, launched_at, port)


@contextlib.contextmanager
def running(
    contender: Contender, how: JobPlan, args: argparse.Namespace, tmpdir: Path | None = None
) -> Iterator[Job]:
    """A started job; afterwards everything it started is killed and checked gone."""
    job = start(contender, how, args, tmpdir)
    try:
        yield job
    finally:
        kill_everything(job.tag)  # raises if anything of the job survived SIGKILL
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(job.tmp, ignore_errors=True)


def all_exited(job: Job) -> int | None:
    """None while a launcher runs; then the first non-zero exit code, or 0."""
    codes = job.exit_codes()
    return None if None in codes else next((c for c in codes if c), 0)


def run_job(contender: Contender, how: JobPlan, run: int, args: argparse.Namespace) -> Outcome:
    """One job to its end (or `--job-timeout`); its measures; what it said if it failed.
    compile-warm: a first job of the same contender fills the caches, and is not measured."""
    outcome = Outcome(how.setting, how.variant, contender.key, run, how.layout.name)
    with contextlib.ExitStack() as stack:
        tmpdir = None
        if how.variant == "compile-warm":
            tmpdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ftrun-warm-")))
            with running(contender, how, args, tmpdir) as first:
                if first.wait(lambda: all_exited(first), args.job_timeout) != 0:
                    outcome.note = "the warm-up job failed"
                    return outcome
        job = stack.enter_context(running(contender, how, args, tmpdir))
        rc = job.wait(lambda: all_exited(job), args.job_timeout)
        outcome.wall_s = time.time() - job.launched_at
        if rc is None:
            # Each launcher leads its own session; workers in groups of their own are left to
            # kill_everything, which also checks that nothing of the job survived.
            for proc in job.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            outcome.note = f"timed out after {args.job_timeout:.0f} s"
        outcome.rc = rc
        lives = [read_lives(job.out, rank) for rank in range(how.layout.world)]
        outcome.measures = measures(lives, job.launched_at, (args.early, args.late))
        last = max((life.last_step for life in lives[0]), default=0)
        outcome.ok = rc == 0 and last >= args.steps
        if not outcome.ok:
            outcome.note = outcome.note or f"launcher exit {rc}, last step {last}/{args.steps}"
            outcome.tail = job.log_tail(0, 25)
            keep_failed(job, outcome, args.out_dir)
    return outcome


def keep_failed(job: Job, outcome: Outcome, out_dir: Path) -> None:
    """Copy a failed job's launcher output and rank logs (not its checkpoint) for a look."""
    dest = out_dir / (
        f"failed-{outcome.layout}gpu-{outcome.setting}-{outcome.variant}-{outcome.contender}"
        f"-run{outcome.run + 1}"
    )
    dest.mkdir(parents=True, exist_ok=True)
    for log in job.tmp.glob("launcher*.log"):
        shutil.copy(log, dest)
    if job.out.exists():
        shutil.copytree(job.out, dest / "out", dirs_exist_ok=True)


# ---- the plan ------------------------------------------------------------------------------------


def plan(args: argparse.Namespace, keys: Sequence[str]) -> Iterator[tuple[int, JobPlan, str]]:
    """(run, what, launcher) in order: runs interleaved, the first launcher rotating."""
    for run in range(args.first_run, args.first_run + args.runs):
        for layout, setting, variant in itertools.product(
            args.layouts, args.settings, args.variants
        ):
            compiled = variant.startswith("compile")
            chosen = [k for k in keys if compiled or not CONTENDERS[k].compile_only]
            turn = run % len(chosen)
            for key in chosen[turn:] + chosen[:turn]:
                yield run, JobPlan(setting, variant, layout), key


def measure(args: argparse.Namespace, keys: Sequence[str]) -> list[Outcome]:
    outcomes = []
    for run, how, key in plan(args, keys):
        outcome = run_job(CONTENDERS[key], how, run, args)
        outcomes.append(outcome)
        where = f"{how.layout.name:>4} GPU {how.setting:9} {how.variant:12} {key:13}"
        progress(f"{where} run {run + 1}: {brief(outcome)}")
    return outcomes


def brief(outcome: Outcome) -> str:
    m = outcome.measures
    text = f"startup {_fmt(m.get('startup'))}"
    for name in ("early", "late"):
        split = ", ".join(f"{k} {_fmt(m.get(f'{name}.to_{k}'))}" for k in MARKS)
        text += f"; {name} {_fmt(m.get(name))} ({split})"
    text += f"; {outcome.wall_s:.0f} s in all"
    return text if outcome.ok else f"FAILED ({outcome.note}); {text}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


# ---- tables --------------------------------------------------------------------------------------

ROWS = [("startup: launch -> first step (s)", "startup")]
for _name in ("early", "late"):
    ROWS += [
        (f"{_name} crash -> first step of the next process (s)", _name),
        (f"  {_name}: crash -> new process started", f"{_name}.to_script"),
        (f"  {_name}: crash -> model on the device", f"{_name}.to_cuda"),
        (f"  {_name}: crash -> process group up", f"{_name}.to_pg"),
        (f"  {_name}: crash -> checkpoint loaded", f"{_name}.to_load"),
        (f"  {_name}: crash -> DDP built (first NCCL use)", f"{_name}.to_ddp"),
        (f"  {_name}: crash -> optimizer restored", f"{_name}.to_opt"),
        (f"  {_name}: crash -> ready to train", f"{_name}.to_ready"),
    ]


def series(group: Sequence[Outcome], key: str, measure: str) -> dict[int, float | None]:
    """Run -> one launcher's figure (None where the job failed or the figure is missing)."""
    return {o.run: o.measures.get(measure) if o.ok else None for o in group if o.contender == key}


def cell(values: dict[int, float | None], failed: int) -> str:
    stats = Stats.of(list(values.values()))
    if stats is None:
        return f"failed ({failed}/{len(values)})" if failed else "-"
    text = stats.cell() if stats.n > 1 else f"{stats.median:.2f}"
    return text + (f", {failed} failed" if failed else "")


def render(group: Sequence[Outcome], markdown: bool) -> str:
    """One setting and variant: a row per measure, a column per launcher and ratio."""
    keys = [k for k in CONTENDERS if any(o.contender == k for o in group)]
    pairs = [(a, b) for a, b in RATIOS if a in keys and b in keys]
    failed = {k: sum(not o.ok for o in group if o.contender == k) for k in keys}
    headers = ["measure", *(CONTENDERS[k].launcher.name for k in keys)]
    headers += [f"{a}/{CONTENDERS[b].launcher.name}" for a, b in pairs]
    headers.append("runs (" + " · ".join(keys) + ")")
    rows = []
    for label, measure in ROWS:
        data = {k: series(group, k, measure) for k in keys}
        row = [label, *(cell(data[k], failed[k]) for k in keys)]
        row += [ratio_cell(pair_ratios(data[a], data[b])) for a, b in pairs]
        row.append(" · ".join(str(sum(v is not None for v in data[k].values())) for k in keys))
        rows.append(row)
    return table(headers, rows, markdown)


def groups(outcomes: Sequence[Outcome]) -> dict[tuple[str, str, str], list[Outcome]]:
    found: dict[tuple[str, str, str], list[Outcome]] = {}
    for o in outcomes:
        found.setdefault((o.layout, o.setting, o.variant), []).append(o)
    return found


def checks(outcomes: Sequence[Outcome]) -> list[tuple[bool, str]]:
    """ftrun/torchrun (median of pair ratios) against the targets, per layout, setting and
    variant; and ftrun's restarts at each layout against its own at 1 GPU (medians)."""
    verdicts = []
    found = groups(outcomes)
    for (layout, setting, variant), group in found.items():
        targets = {"startup": STARTUP_TARGET}
        targets.update(dict.fromkeys(("early", "late"), RECOVERY_TARGET[variant]))
        for measure, limit in targets.items():
            ratios = pair_ratios(
                series(group, "ftrun", measure), series(group, "torchrun", measure)
            )
            verdicts.append(_verdict(f"{layout} GPU {setting}/{variant} {measure}: ftrun/torchrun",
                                     ratios, limit))  # fmt: skip
        single = found.get(("1", setting, variant))
        for measure in ("early", "late") if single and layout != "1" else ():
            mine = Stats.of(list(series(group, "ftrun", measure).values()))
            base = Stats.of(list(series(single, "ftrun", measure).values()))
            ratio = [mine.median / base.median] if mine and base else []
            verdicts.append(_verdict(f"{layout} GPU {setting}/{variant} {measure}: ftrun / ftrun "
                                     "at 1 GPU", ratio, WIDTH_TARGET))  # fmt: skip
    return verdicts


def _verdict(where: str, ratios: Sequence[float], limit: float) -> tuple[bool, str]:
    if not ratios:
        return False, f"FAIL {where}: no pair of figures"
    med = Stats.of(list(ratios)).median
    line = f"{where} {med:.3f} (target <= {limit:.2f}, {len(ratios)} pairs)"
    return med <= limit, f"{'PASS' if med <= limit else 'FAIL'} {line}"


def report(outcomes: Sequence[Outcome], machine: str, markdown: bool) -> None:
    print(f"machine: {machine}")
    for (layout, setting, variant), group in groups(outcomes).items():
        print(f"\n{Layout.parse(layout).world} GPU(s) as {layout}, {setting}, {variant}:\n")
        print(render(group, markdown))
    print(
        "\nmedian (min-max) over the jobs that ended well; ratios: median (min-max) of run i / "
        "run i; runs: figures per launcher. The split is cumulative from the crash; a process "
        "a launcher started ahead of the crash shows a negative start. Compile variant: each "
        "job starts with empty caches; restarts within a job may use what earlier cycles wrote; "
        "compile-warm: each measured job follows an unmeasured one of the same launcher that "
        "filled torch's default caches (a user's second job). Restarts: the slowest rank."
    )
    for o in outcomes:
        if not o.ok:
            print(f"\nFAILED {o.setting}/{o.variant} {o.contender} run {o.run + 1}: {o.note}")
            print("    " + o.tail.replace("\n", "\n    "))


# ---- the machine and the raw results -------------------------------------------------------------


def write_json(path: Path, outcomes: Sequence[Outcome], machine: str, args: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = {"machine": machine, "args": args, "jobs": [dataclasses.asdict(o) for o in outcomes]}
    path.write_text(json.dumps(raw, indent=1))


def read_json(paths: Sequence[Path]) -> tuple[list[Outcome], str]:
    """Jobs of earlier calls, merged (the machine line of the first file)."""
    raws = [json.loads(path.read_text()) for path in paths]
    jobs = [Outcome(**job) for raw in raws for job in raw["jobs"]]
    return jobs, raws[0]["machine"]


def main() -> None:
    args = parse_args()
    if args.from_json:
        outcomes, machine = read_json(args.from_json)
    else:
        keys = list(args.launchers)
        if "nvrx" in keys and not nvrx_importable():
            progress("NVRx left out: `import nvidia_resiliency_ext` fails here")
            keys.remove("nvrx")
        take_charge()
        machine = machine_line(args.device)
        progress(f"machine: {machine}")
        started = time.strftime("%Y%m%d-%H%M%S")
        outcomes = measure(args, keys)
        path = args.json or args.out_dir / f"gpu-compare-{started}.json"
        write_json(path, outcomes, machine, {k: str(v) for k, v in vars(args).items()})
        progress(f"raw results: {path}")
    report(outcomes, machine, args.markdown)
    if args.check:
        verdicts = checks(outcomes)
        print("\n" + "\n".join(line for _, line in verdicts))
        if not all(ok for ok, _ in verdicts):
            sys.exit(1)


if __name__ == "__main__":
    main()
