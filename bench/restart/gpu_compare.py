"""One GPU, one plain training script, three launchers: ft_launcher, torchrun and NVRx 0.7.0.

Every job runs `bench/workers/gpu_user_worker.py` (151M transformer, AdamW, DDP over NCCL,
`torch.save` every `--ckpt-every` steps, no client of any launcher) under one launcher with
`--standalone --nproc-per-node=1 --max-restarts=3` (a fresh store port per job, chosen by the
launcher) in a fresh directory. The worker crashes once at `--early` (5) and once at `--late`
(35), and trains on to `--steps` (late + 10) from the checkpoint. A job counts when its launcher
exits 0 and the last step was reached; otherwise it is recorded as failed, with the tail of its
output. Jobs are interleaved (run 1 of every setting, variant and launcher, then run 2, ...),
and the launcher that goes first rotates from run to run.

Contenders: `ftrun` (`python -m ftrun.ft_launcher.cli`, which works from PYTHONPATH=src without
console scripts), `torchrun` (`python -m torch.distributed.run`), `nvrx` (NVRx's launcher
`main`, with NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1; left out when it does not import). ftrun and
NVRx get `--ft-rank-section-timeouts=step:60`, as in compare.py. Settings: `omp-unset`
(OMP_NUM_THREADS removed) and `omp1` (OMP_NUM_THREADS=1). Variants: `plain` and `compile`
(worker `--compile`); the compile variant adds `ftrun-nocache`: ftrun with
TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, a restart of a compiled model without warm caches.

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
import importlib
import importlib.metadata
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
from bench.common.jobs import SECTION_ARGS, TAG_ENV, Job, Launcher, kill_everything, take_charge
from bench.common.logs import parse_step_line
from bench.common.report import Stats, pair_ratios, progress, ratio_cell, table

WORKER = WORKERS / "gpu_user_worker.py"
PY = sys.executable
NVRX_MAIN = "from nvidia_resiliency_ext.fault_tolerance.launcher import main; main()"
RDZV_ARGS = ("--standalone", "--nproc-per-node=1", "--max-restarts=3")
SMALL_MODEL = ("--d-model", "128", "--layers", "2", "--batch", "2", "--seq", "64")
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")
SETTINGS = {"omp-unset": None, "omp1": "1"}  # -> OMP_NUM_THREADS (None: removed)
VARIANTS = ("plain", "compile")
# The restart's split, in the order the marks happen.
MARKS = ("script", "cuda", "pg", "load", "ddp", "opt", "ready")
STARTUP_TARGET = 1.0  # ftrun/torchrun, median of pair ratios
RECOVERY_TARGET = {"plain": 0.25, "compile": 0.3}  # early and late, ftrun/torchrun


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
TORCHRUN = Launcher("torchrun", (PY, "-m", "torch.distributed.run"), None)
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


@dataclasses.dataclass
class Outcome:
    """One job: one launcher in one setting and variant, one run."""

    setting: str
    variant: str
    contender: str
    run: int
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


def job_env(contender: Contender, setting: str, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    env.pop("VIRTUAL_ENV", None)
    env.pop("OMP_NUM_THREADS", None)
    if SETTINGS[setting] is not None:
        env["OMP_NUM_THREADS"] = SETTINGS[setting]
    if contender.fresh_caches:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "cache" / "inductor")
        env["TRITON_CACHE_DIR"] = str(tmp / "cache" / "triton")
    # What a launcher or torch leaves in the temporary directory stays with the job.
    env.update(dict(contender.launcher.env), TMPDIR=str(tmp / "tmp"), PYTHONUNBUFFERED="1")
    env[TAG_ENV] = str(tmp)
    return env


def worker_args(args: argparse.Namespace, variant: str, tmp: Path) -> list[str]:
    argv = [str(WORKER), "--out", str(tmp / "out"), "--ckpt-dir", str(tmp / "ckpt")]
    argv += ["--crash-at-step", str(args.early), "--crash-at-step", str(args.late)]
    argv += ["--ckpt-every", "10", "--steps", str(args.steps), "--device", args.device]
    if args.device == "cpu":
        argv += SMALL_MODEL
    return [*argv, "--compile"] if variant == "compile" else argv


def start(contender: Contender, setting: str, variant: str, args: argparse.Namespace) -> Job:
    tmp = Path(tempfile.mkdtemp(prefix=f"ftrun-gpu-{contender.key}-"))
    (tmp / "tmp").mkdir()
    argv = [*contender.launcher.argv, *RDZV_ARGS, *contender.launcher.args]
    argv += worker_args(args, variant, tmp)
    env = job_env(contender, setting, tmp)
    with (tmp / "launcher0.log").open("wb") as log:
        launched_at = time.time()
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True
        )
    return Job(contender.launcher, tmp, tmp / "out", [proc], launched_at)


@contextlib.contextmanager
def running(
    contender: Contender, setting: str, variant: str, args: argparse.Namespace
) -> Iterator[Job]:
    """A started job; afterwards everything it started is killed and checked gone."""
    job = start(contender, setting, variant, args)
    try:
        yield job
    finally:
        kill_everything(job.tag)  # raises if anything of the job survived SIGKILL
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(job.tmp, ignore_errors=True)


def run_job(
    contender: Contender, setting: str, variant: str, run: int, args: argparse.Namespace
) -> Outcome:
    """One job to its end (or `--job-timeout`); its measures; what it said if it failed."""
    outcome = Outcome(setting, variant, contender.key, run)
    with running(contender, setting, variant, args) as job:
        rc = job.wait(job.procs[0].poll, args.job_timeout)
        outcome.wall_s = time.time() - job.launched_at
        if rc is None:
            # The launcher leads its own session; workers in groups of their own are left to
            # kill_everything, which also checks that nothing of the job survived.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.procs[0].pid, signal.SIGKILL)
            outcome.note = f"timed out after {args.job_timeout:.0f} s"
        outcome.rc = rc
        lives = read_lives(job.out)
        outcome.measures = measures(lives, job.launched_at, args)
        last = max((life.last_step for life in lives), default=0)
        outcome.ok = rc == 0 and last >= args.steps
        if not outcome.ok:
            outcome.note = outcome.note or f"launcher exit {rc}, last step {last}/{args.steps}"
            outcome.tail = job.log_tail(0, 25)
            keep_failed(job, outcome, args.out_dir)
    return outcome


def keep_failed(job: Job, outcome: Outcome, out_dir: Path) -> None:
    """Copy a failed job's launcher output and rank logs (not its checkpoint) for a look."""
    dest = out_dir / (
        f"failed-{outcome.setting}-{outcome.variant}-{outcome.contender}-run{outcome.run + 1}"
    )
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(job.tmp / "launcher0.log", dest)
    if job.out.exists():
        shutil.copytree(job.out, dest / "out", dirs_exist_ok=True)


# ---- rank 0's log --------------------------------------------------------------------------------


@dataclasses.dataclass
class Life:
    """One worker process, from its lines: its marks, first step, last step, crash."""

    pid: int
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    first_step: float | None = None
    last_step: int = 0
    fault: tuple[int, float] | None = None  # (step, wall clock)


def read_lives(out: Path) -> list[Life]:
    """Rank 0's processes in the order they first logged (complete lines only)."""
    path = out / "rank0.log"
    lives: dict[int, Life] = {}
    lines = path.read_text(errors="replace").split("\n")[:-1] if path.exists() else []
    for line in lines:
        step = parse_step_line(line)
        if step is None:
            _add_mark(lives, line)
            continue
        life = lives.setdefault(step.pid, Life(step.pid))
        if step.fault:
            life.fault = (step.step, step.ts)
        else:
            life.first_step = life.first_step or step.ts
            life.last_step = max(life.last_step, step.step)
    return list(lives.values())


def _add_mark(lives: dict[int, Life], line: str) -> None:
    """`<ts> rank= pid= mark=<name> [proc=<ts>]`; `start` is recorded as `script`, at the
    process's start (`proc`) when the worker could read it."""
    fields = line.split()
    with contextlib.suppress(ValueError, KeyError, IndexError):
        values = dict(field.split("=", 1) for field in fields[1:] if "=" in field)
        mark, pid = values["mark"], int(values["pid"])
        name, ts = mark, float(fields[0])
        if mark == "start":
            name, ts = "script", float(values.get("proc", ts))
        lives.setdefault(pid, Life(pid)).marks[name] = ts


def _since(ts: float | None, origin: float) -> float | None:
    return None if ts is None else ts - origin


def measures(
    lives: Sequence[Life], launched_at: float, args: argparse.Namespace
) -> dict[str, float | None]:
    found: dict[str, float | None] = {
        "startup": _since(lives[0].first_step if lives else None, launched_at)
    }
    for name, step in (("early", args.early), ("late", args.late)):
        found.update(restart(lives, name, step))
    return found


def restart(lives: Sequence[Life], name: str, step: int) -> dict[str, float | None]:
    """The crash at `step` -> the next process's marks and first step (`name`), cumulative."""
    found: dict[str, float | None] = dict.fromkeys([name, *(f"{name}.to_{m}" for m in MARKS)])
    crashed = next((i for i, life in enumerate(lives) if life.fault and life.fault[0] == step), -1)
    if crashed < 0:
        return found
    crash_ts = lives[crashed].fault[1]
    after = (life for life in lives[crashed + 1 :] if (life.first_step or 0) > crash_ts)
    successor = next(after, None)
    if successor is None:
        return found
    found[name] = _since(successor.first_step, crash_ts)
    found.update({f"{name}.to_{m}": _since(successor.marks.get(m), crash_ts) for m in MARKS})
    return found


# ---- the plan ------------------------------------------------------------------------------------


def plan(args: argparse.Namespace, keys: Sequence[str]) -> Iterator[tuple[int, str, str, str]]:
    """(run, setting, variant, launcher) in order: runs interleaved, the first launcher rotating."""
    for run in range(args.first_run, args.first_run + args.runs):
        for setting, variant in itertools.product(args.settings, args.variants):
            chosen = [k for k in keys if variant == "compile" or not CONTENDERS[k].compile_only]
            turn = run % len(chosen)
            for key in chosen[turn:] + chosen[:turn]:
                yield run, setting, variant, key


def measure(args: argparse.Namespace, keys: Sequence[str]) -> list[Outcome]:
    outcomes = []
    for run, setting, variant, key in plan(args, keys):
        outcome = run_job(CONTENDERS[key], setting, variant, run, args)
        outcomes.append(outcome)
        progress(f"{setting:9} {variant:7} {key:13} run {run + 1}: {brief(outcome)}")
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


def groups(outcomes: Sequence[Outcome]) -> dict[tuple[str, str], list[Outcome]]:
    found: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        found.setdefault((o.setting, o.variant), []).append(o)
    return found


def checks(outcomes: Sequence[Outcome]) -> list[tuple[bool, str]]:
    """ftrun/torchrun (median of pair ratios) against the targets, per setting and variant."""
    verdicts = []
    for (setting, variant), group in groups(outcomes).items():
        targets = {"startup": STARTUP_TARGET}
        targets.update(dict.fromkeys(("early", "late"), RECOVERY_TARGET[variant]))
        for measure, limit in targets.items():
            ratios = pair_ratios(
                series(group, "ftrun", measure), series(group, "torchrun", measure)
            )
            where = f"{setting}/{variant} {measure}: ftrun/torchrun"
            if not ratios:
                verdicts.append((False, f"FAIL {where}: no pair of figures"))
                continue
            med = Stats.of(ratios).median
            ok = med <= limit
            line = f"{where} {med:.3f} (target <= {limit:.2f}, {len(ratios)} pairs)"
            verdicts.append((ok, f"{'PASS' if ok else 'FAIL'} {line}"))
    return verdicts


def report(outcomes: Sequence[Outcome], machine: str, markdown: bool) -> None:
    print(f"machine: {machine}")
    for (setting, variant), group in groups(outcomes).items():
        print(f"\n{setting}, {variant}:\n")
        print(render(group, markdown))
    print(
        "\nmedian (min-max) over the jobs that ended well; ratios: median (min-max) of run i / "
        "run i; runs: figures per launcher. The split is cumulative from the crash; a process "
        "a launcher started ahead of the crash shows a negative start. Compile variant: each "
        "job starts with empty caches; restarts within a job may use what earlier cycles wrote."
    )
    for o in outcomes:
        if not o.ok:
            print(f"\nFAILED {o.setting}/{o.variant} {o.contender} run {o.run + 1}: {o.note}")
            print("    " + o.tail.replace("\n", "\n    "))


# ---- the machine and the raw results -------------------------------------------------------------


def nvrx_importable() -> bool:
    try:
        importlib.import_module("nvidia_resiliency_ext")
    except Exception:  # whatever it raises, NVRx cannot run here
        return False
    return True


def cuda_in_child() -> bool:
    """Whether torch sees a GPU, asked of a child: this process holds no CUDA context."""
    code = "import torch; print(torch.cuda.is_available())"
    said = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
    return said.stdout.strip() == "True"


def machine_line(device: str) -> str:
    """GPU (or CPU), cores, torch and NVRx versions; asked of a child, so that this process
    holds no CUDA context while the jobs run."""
    gpu = "torch.cuda.get_device_name()" if device == "cuda" else "'CPU'"
    code = f"import torch; print(torch.__version__); print({gpu})"
    said = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
    found = said.stdout.split("\n") if said.returncode == 0 else []
    torch_version, gpu = [*found, "?", "?"][:2]
    try:
        nvrx = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        nvrx = "not installed"
    return f"{gpu}; {os.cpu_count()} cores; torch {torch_version}; NVRx {nvrx}"


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
