"""In-process restart on GPUs: ftrun's wrapper beside NVRx's, and in-job restarts beside both.

One script, `bench/workers/gpu_user_worker.py`'s 151M transformer (AdamW, DDP over NCCL,
`torch.save` every `--ckpt-every` steps, optionally `--compile`d), in four contenders, each
launched with `--standalone --nproc-per-node=N --max-restarts=3` in a fresh directory:

- `ftrun-inprocess`: the wrapped worker (`bench/workers/gpu_inprocess_worker.py`, model and
  compile outside the wrapped function, process group and DDP inside) with `--wrapper ftrun`,
  under ft_launcher (`python -m ftrun.ft_launcher.cli`);
- `nvrx-inprocess`: the same worker with `--wrapper nvrx`, under torchrun, as NVRx's usage guide
  runs its examples (`torchrun --nproc-per-node=N`; monitor interval at its default, 0.1 s);
- `ftrun-inprocess-snap`, `nvrx-inprocess-snap`: `--restore snapshot`, ftrun's `StepSnapshot`
  of every step in node memory, the same API under either wrapper; their ratios are taken
  against each other;
- `ftrun-inprocess-peer`, `nvrx-inprocess-peer`: `--restore peer`, the snapshot restored with
  `replicated=True` (a rank without the newest step, a replaced rank's new process where node
  memory lost it, takes it from a peer by broadcast over NCCL); `-peer-dev`: also
  `--init-on-device` (the model built on the GPU, not moved there);
- `ftrun-injob`, `torchrun-injob`: the unwrapped gpu_user_worker.py, crashing at the same step,
  under ft_launcher / torchrun (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see NO_SHARE): every
  rank's process is replaced.

Both wrapped contenders get what NVRx's guide asks of the environment for in-process restart
(`TORCH_NCCL_RETHROW_CUDA_ERRORS=0`, `NCCL_NVLS_ENABLE=0`) and its example's `Wrapper`
arguments (the worker's docstring). Cases (`fault:variant`): `raise` (a RuntimeError in rank
`--fault-rank` at `--fault-step`, once: every contender), `kill` (that rank SIGKILLs itself: the
wrapped contenders; a new process is the launcher's to start, for that rank alone or for all:
the table says how many ranks came back in a new process), `abort-hang` (a RuntimeError,
with that rank's NCCL abort made to hang: ftrun's wrapper only, with
FTRUN_INPROCESS_ABORT_TIMEOUT=`--abort-bound`; NVRx bounds no abort).
Variants `plain` and `compile`; GPUs per job: `--nproc` (e.g. 1,4). Torchrun's jobs get fresh
inductor/triton caches in their directory; ft_launcher's use torch's default in the job's TMPDIR.

Measures, from the ranks' wall-clock lines: fault (the faulting rank's line, just before the
raise or kill) -> every rank's first step in a new life (a new process or restart iteration),
the last rank's; -> the function re-entered or the new process started; -> ready to train;
the ranks back and how many of them in a new process. A job counts when its launcher exits 0
and rank 0 reached `--steps`. Runs are interleaved (run 1 of every case and contender, then
run 2, ...), the first contender rotating; ratios are pair by pair against the NVRx contender
of the same restore.
Raw results: `--json` (rewritten after every job); `--from-json` tabulates earlier calls.
`--budget-s` starts no job past that many seconds (a device call has a time limit).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import OUT, WORKERS, smoke
from bench.common.gpu_host import cuda_in_child, nvrx_importable
from bench.common.jobs import TAG_ENV, kill_everything, take_charge
from bench.common.report import Stats, pair_ratios, progress, ratio_cell, table
from bench.restart.gpu_compare import CACHE_ENV, NO_SHARE, PY, SMALL_MODEL, _subset

WRAPPED = WORKERS / "gpu_inprocess_worker.py"
PLAIN = WORKERS / "gpu_user_worker.py"
FT = (PY, "-m", "ftrun.ft_launcher.cli")
TORCHRUN = (PY, "-m", "torch.distributed.run")
INPROCESS_ENV = (("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0"),)
# The device's rule (KINDS.md): NVLink multicast stays off, in every process.
DEVICE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
CASES = ("raise:plain", "raise:compile", "kill:plain", "abort-hang:plain")
TARGETS = {("raise", "plain"): 1.0, ("raise", "compile"): 1.5, ("kill", "plain"): 2.0}
"""The issue's bounds for ftrun-inprocess at 4 GPUs (s, fault -> all ranks stepping)."""
PEER = "nvrx-inprocess"
SPLIT = (("enter", ("enter", "start")), ("pg", ("pg",)), ("load", ("load",)), ("ddp", ("ddp",)),
         ("ready", ("ready",)))  # fmt: skip
"""A restart's split: the function re-entered (or the new process started), process group,
checkpoint loaded, DDP built (its first NCCL use), ready to train: each the last rank's."""
NEW_PROCESS = ("start", "cuda")
"""A new process's own marks: its script's first line, its model and optimizer on the device."""


@dataclasses.dataclass(frozen=True)
class Contender:
    key: str
    launcher: tuple[str, ...]
    wrapper: str | None  # ftrun|nvrx: the wrapped worker; None: gpu_user_worker.py
    faults: tuple[str, ...]
    fresh_caches: bool = False
    env: tuple[tuple[str, str], ...] = ()
    worker_args: tuple[str, ...] = ()
    peer: str = PEER
    """The contender its ratios are taken against (run i / run i)."""


PEER_STATE = ("--restore", "peer")
STEP_SNAPSHOT = ("--restore", "snapshot")
NVRX_ENV = (*INPROCESS_ENV, ("NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE", "1"))


CONTENDERS = {c.key: c for c in (
    Contender("ftrun-inprocess", FT, "ftrun", ("raise", "kill", "abort-hang"), env=INPROCESS_ENV),
    Contender(PEER, TORCHRUN, "nvrx", ("raise", "kill"), fresh_caches=True, env=NVRX_ENV),
    Contender("ftrun-inprocess-peer", FT, "ftrun", ("raise", "kill"), env=INPROCESS_ENV,
              worker_args=PEER_STATE, peer="nvrx-inprocess-peer"),
    Contender("ftrun-inprocess-peer-dev", FT, "ftrun", ("raise", "kill"), env=INPROCESS_ENV,
              worker_args=(*PEER_STATE, "--init-on-device"), peer="nvrx-inprocess-peer-dev"),
    Contender("nvrx-inprocess-peer", TORCHRUN, "nvrx", ("raise", "kill"), fresh_caches=True,
              env=NVRX_ENV, worker_args=PEER_STATE),
    Contender("nvrx-inprocess-peer-dev", TORCHRUN, "nvrx", ("raise", "kill"), fresh_caches=True,
              env=NVRX_ENV, worker_args=(*PEER_STATE, "--init-on-device")),
    Contender("ftrun-inprocess-snap", FT, "ftrun", ("raise", "kill"), env=INPROCESS_ENV,
              worker_args=STEP_SNAPSHOT, peer="nvrx-inprocess-snap"),
    Contender("nvrx-inprocess-snap", TORCHRUN, "nvrx", ("raise", "kill"), fresh_caches=True,
              env=NVRX_ENV, worker_args=STEP_SNAPSHOT),
    Contender("ftrun-injob", FT, None, ("raise",)),
    Contender("torchrun-injob", TORCHRUN, None, ("raise",), fresh_caches=True, env=NO_SHARE),
)}  # fmt: skip


@dataclasses.dataclass
class Outcome:
    """One job: a contender, a case, a GPU count, one run."""

    nproc: int
    fault: str
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
    parser.add_argument("--nproc", type=lambda s: [int(n) for n in s.split(",")], default=[4],
                        help="GPUs (ranks) per job, comma-separated (default 4)")  # fmt: skip
    for flag, choices in (("cases", CASES), ("contenders", CONTENDERS)):
        parser.add_argument(f"--{flag}", type=_subset(choices), default=list(choices),
                            help=f"comma-separated, of {','.join(choices)}")  # fmt: skip
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a small model, gloo")  # fmt: skip
    parser.add_argument("--steps", type=int, default=25, help="steps in all")
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--fault-rank", type=int, default=1, help="(rank 0 on one GPU)")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--abort-bound", type=float, default=5.0,
                        help="FTRUN_INPROCESS_ABORT_TIMEOUT for abort-hang (s)")  # fmt: skip
    parser.add_argument("--job-timeout", type=float, default=90.0,
                        help="s per job (twice that compiled)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=0.0, help="no job starts past it")
    parser.add_argument("--out-dir", type=Path, default=OUT, help="failed jobs' logs")
    parser.add_argument("--json", type=Path, help="default: OUT_DIR/inprocess-<time>.json")
    parser.add_argument("--from-json", type=Path, nargs="+", help="tabulate these; run nothing")
    parser.add_argument("--markdown", action="store_true", help="markdown tables")
    sizes = {"runs": 1, "nproc": [2], "cases": ["raise:plain"], "steps": 8, "fault_step": 5,
             "ckpt_every": 3, "job_timeout": 120.0}  # fmt: skip
    args = smoke.parse_args(parser, sizes, argv)
    if args.smoke and not args.from_json and not cuda_in_child():
        args.device = "cpu"
        smoke.skip_gpu("inprocess_compare", "the GPU jobs (its CPU path, --device cpu, runs)")
    if not 0 < args.ckpt_every < args.fault_step < args.steps:
        parser.error("need 0 < --ckpt-every < --fault-step < --steps")
    return args


# ---- one job -------------------------------------------------------------------------------------


def job_env(c: Contender, tmp: Path, fault: str, args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    env.pop("VIRTUAL_ENV", None)
    env.update(DEVICE_ENV, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp / "tmp"))
    if c.fresh_caches:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "cache" / "inductor")
        env["TRITON_CACHE_DIR"] = str(tmp / "cache" / "triton")
    if fault == "abort-hang":
        env["FTRUN_INPROCESS_ABORT_TIMEOUT"] = str(args.abort_bound)
    env.update(dict(c.env))
    env[TAG_ENV] = str(tmp)
    return env


def job_argv(
    c: Contender, nproc: int, fault: str, variant: str, tmp: Path, args: argparse.Namespace
) -> list[str]:
    rank = min(args.fault_rank, nproc - 1)
    argv = [*c.launcher, "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=3"]
    if c.wrapper is None:
        argv += [str(PLAIN), "--crash-at-step", str(args.fault_step), "--crash-rank", str(rank)]
    else:
        argv += [str(WRAPPED), "--wrapper", c.wrapper, "--fault", fault]
        argv += ["--fault-step", str(args.fault_step), "--fault-rank", str(rank)]
        argv += c.worker_args
    argv += [
        "--out",
        str(tmp / "out"),
        "--ckpt-dir",
        str(tmp / "ckpt"),
        "--steps",
        str(args.steps),
        "--ckpt-every",
        str(args.ckpt_every),
        "--device",
        args.device,
    ]
    argv += list(SMALL_MODEL) if args.device == "cpu" else []
    return [*argv, "--compile"] if variant == "compile" else argv


def run_job(
    c: Contender, nproc: int, fault: str, variant: str, run: int, args: argparse.Namespace
) -> Outcome:
    """One job to its end (or `--job-timeout`: its ranks' stacks are taken, then it is
    killed); its measures; what it said if it failed."""
    outcome = Outcome(nproc, fault, variant, c.key, run)
    tmp = Path(tempfile.mkdtemp(prefix=f"ftrun-ipc-{c.key}-"))
    (tmp / "tmp").mkdir()
    try:
        with (tmp / "launcher.log").open("wb") as log:
            launched_at = time.time()
            proc = subprocess.Popen(job_argv(c, nproc, fault, variant, tmp, args), stdout=log,
                                    stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True,
                                    env=job_env(c, tmp, fault, args))  # fmt: skip
        limit = args.job_timeout * (2 if variant == "compile" else 1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(limit)
        outcome.wall_s = time.time() - launched_at
        if proc.poll() is None:
            outcome.note = f"timed out after {limit:.0f} s"
            if c.wrapper is not None:  # gpu_user_worker.py has no handler: SIGUSR1 would end it
                outcome.note += " (stacks taken)"
                take_stacks(tmp / "out", nproc)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        outcome.rc = proc.wait(10)
        lives = [read_rank(tmp / "out", r) for r in range(nproc)]
        outcome.measures = measures(lives, launched_at)
        outcome.measures.update(wrapper_phases(tmp / "launcher.log"))
        last = max((s.step for s in lives[0] if s.kind == "step"), default=0)
        outcome.ok = outcome.rc == 0 and last >= args.steps
        if not outcome.ok:
            outcome.note = outcome.note or f"launcher exit {outcome.rc}, last step {last}"
            outcome.tail = tails(tmp)
            keep = args.out_dir / f"failed-{nproc}gpu-{fault}-{variant}-{c.key}-run{run + 1}"
            skip = shutil.ignore_patterns("ckpt", "cache", "tmp")
            shutil.copytree(tmp, keep, ignore=skip, dirs_exist_ok=True)
    finally:
        kill_everything(str(tmp))  # raises if anything of the job survived SIGKILL
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    return outcome


def take_stacks(out: Path, nproc: int) -> None:
    """SIGUSR1 to each rank's newest process (the wrapped worker dumps its threads' stacks)."""
    for rank in range(nproc):
        lines = read_rank(out, rank)
        if lines:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(lines[-1].pid, signal.SIGUSR1)
    time.sleep(2.0)


def tails(tmp: Path) -> str:
    """The launcher's last lines, each rank's last lines and any stacks taken."""
    parts = []
    files = [tmp / "launcher.log", *sorted((tmp / "out").glob("*"))]
    for path in files:
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()
            keep = 60 if path.name.startswith(("launcher", "stack")) else 6
            parts.append(f"--- {path.name}\n" + "\n".join(lines[-keep:]))
    return "\n".join(parts)


# ---- the ranks' lines ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Line:
    """`<ts> rank= pid= step=|mark= [it=] [fault=]`: a step, a fault or a mark (`name`)."""

    ts: float
    pid: int
    it: int
    kind: str  # step | fault | mark
    name: str = ""
    step: int = 0
    proc: float | None = None  # a start mark's: when the process was forked


def read_rank(out: Path, rank: int) -> list[Line]:
    path = out / f"rank{rank}.log"
    found = []
    for text in path.read_text(errors="replace").split("\n")[:-1] if path.exists() else []:
        fields = text.split()
        with contextlib.suppress(ValueError, KeyError, IndexError):
            v = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
            ts, pid, it = float(fields[0]), int(v["pid"]), int(v.get("it", 0))
            if "mark" in v:
                proc = float(v["proc"]) if "proc" in v else None
                found.append(Line(ts, pid, it, "mark", v["mark"], proc=proc))
            else:
                kind = "fault" if "fault" in v else "step"
                found.append(Line(ts, pid, it, kind, v.get("fault", ""), int(v["step"])))
    return found


def wrapper_phases(launcher_log: Path) -> dict[str, float | None]:
    """ftrun's wrapper's own split of the first restart (`in-process restart: rank R entered
    iteration 1 after T s: abort 0.123s, ...`): each phase's longest over the ranks, as
    `phase_<name>`. A replaced rank's new process logs none."""
    found: dict[str, float | None] = {}
    text = launcher_log.read_text(errors="replace") if launcher_log.exists() else ""
    for line in text.splitlines():
        if "entered iteration 1 after" not in line:
            continue
        for part in line.split(": ")[-1].split(", "):
            with contextlib.suppress(ValueError):
                name, seconds = part.split()
                value = float(seconds.rstrip("s"))
                found[f"phase_{name}"] = max(found.get(f"phase_{name}") or 0.0, value)
    return found


def measures(lives: Sequence[list[Line]], launched_at: float) -> dict[str, float | None]:
    firsts = [next((s.ts for s in lines if s.kind == "step"), None) for lines in lives]
    found: dict[str, float | None] = {"startup": None}
    if firsts and all(firsts):
        found["startup"] = max(firsts) - launched_at
    faults = [s for lines in lives for s in lines if s.kind == "fault"]
    if not faults:
        return found
    at = min(faults, key=lambda s: s.ts).ts
    back: dict[str, list[float]] = {"back": [], "to_fork": [],
                                    **{f"to_{m}": [] for m, _ in SPLIT},
                                    **{f"new_{m}": [] for m in NEW_PROCESS}}  # fmt: skip
    replaced = 0
    for lines in lives:
        old = {(s.pid, s.it) for s in lines if s.ts <= at}
        new = [s for s in lines if s.ts > at and (s.pid, s.it) not in old]
        step = next((s for s in new if s.kind == "step"), None)
        if step is None:
            continue  # this rank did not come back (the job failed, or went on without it)
        replaced += step.pid not in {pid for pid, _ in old}
        back["back"].append(step.ts - at)
        life = [s for s in new if (s.pid, s.it) == (step.pid, step.it)]  # the one that stepped
        forked = [s.proc for s in new if s.pid == step.pid and s.proc is not None]
        if forked:  # a new process (its start mark is iteration 0's): when it was forked
            back["to_fork"].append(forked[0] - at)
        for name in NEW_PROCESS:
            mark = next((s for s in new if s.pid == step.pid and s.name == name), None)
            if mark is not None and step.pid not in {pid for pid, _ in old}:
                back[f"new_{name}"].append(mark.ts - at)
        for key, names in SPLIT:
            mark = next((s for s in life if s.kind == "mark" and s.name in names), None)
            if mark is not None:
                back[f"to_{key}"].append(mark.ts - at)
    found.update({key: max(values) if values else None for key, values in back.items()})
    found.update(ranks_back=len(back["back"]), replaced=replaced)
    return found


# ---- the plan, the tables ------------------------------------------------------------------------


def plan(args: argparse.Namespace, keys: Sequence[str]):
    """(run, nproc, fault, variant, contender) in order: runs interleaved, the first rotating."""
    for run in range(args.first_run, args.first_run + args.runs):
        for nproc in args.nproc:
            for case in args.cases:
                fault, variant = case.split(":")
                chosen = [k for k in keys if fault in CONTENDERS[k].faults]
                turn = run % max(1, len(chosen))
                for key in chosen[turn:] + chosen[:turn]:
                    yield run, nproc, fault, variant, key


def measure(args: argparse.Namespace, keys: Sequence[str], path: Path, machine: str):
    outcomes: list[Outcome] = []
    started = time.monotonic()
    for run, nproc, fault, variant, key in plan(args, keys):
        if args.budget_s and time.monotonic() - started > args.budget_s:
            progress(f"budget of {args.budget_s:.0f} s spent: no more jobs")
            break
        outcome = run_job(CONTENDERS[key], nproc, fault, variant, run, args)
        outcomes.append(outcome)
        write_json(path, outcomes, machine, args)
        progress(f"{nproc} GPU {fault:10} {variant:7} {key:15} run {run + 1}: {brief(outcome)}")
    return outcomes


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def brief(o: Outcome) -> str:
    m = o.measures
    keys = ("to_fork", *(f"new_{k}" for k in NEW_PROCESS), *(f"to_{k}" for k, _ in SPLIT))
    split = ", ".join(f"{k.split('_', 1)[1]} {_fmt(m.get(k))}" for k in keys if k in m)
    phases = ", ".join(f"{k[6:]} {_fmt(v)}" for k, v in m.items() if k.startswith("phase_"))
    split += f"; wrapper's longest: {phases}" if phases else ""
    text = (f"fault -> all stepping {_fmt(m.get('back'))} ({split}; "
            f"ranks back {m.get('ranks_back', '-')}, "
            f"replaced {m.get('replaced', '-')}); startup {_fmt(m.get('startup'))}; "
            f"{o.wall_s:.0f} s in all")  # fmt: skip
    return text if o.ok else f"FAILED ({o.note}); {text}"


def series(group: Sequence[Outcome], key: str, name: str) -> dict[int, float | None]:
    return {o.run: o.measures.get(name) if o.ok else None for o in group if o.contender == key}


def cell(values: dict[int, float | None]) -> str:
    stats = Stats.of(list(values.values()))
    return "-" if stats is None else stats.cell() if stats.n > 1 else f"{stats.median:.2f}"


def render(group: Sequence[Outcome], markdown: bool) -> str:
    fault, variant, nproc = group[0].fault, group[0].variant, group[0].nproc
    headers = ["contender", "fault -> all ranks stepping (s)", "-> re-entered / new process",
               "-> ready to train", "ranks back (in new processes)", "runs ok", "x its NVRx peer",
               "target (4 GPUs)"]  # fmt: skip
    rows = []
    for key in [k for k in CONTENDERS if any(o.contender == k for o in group)]:
        mine = [o for o in group if o.contender == key]
        backs = {f"{o.measures.get('ranks_back', 0)} ({o.measures.get('replaced', 0)})"
                 for o in mine}  # fmt: skip
        contender = CONTENDERS[key]
        ratios = pair_ratios(series(group, key, "back"), series(group, contender.peer, "back"))
        ratio = "-" if contender.wrapper == "nvrx" else ratio_cell(ratios)
        ours = contender.wrapper == "ftrun"
        limit = TARGETS.get((fault, variant)) if ours and nproc == 4 else None
        met = Stats.of(list(series(group, key, "back").values()))
        target = "-" if limit is None else f"<= {limit}: " + (
            "yes" if met and met.median <= limit else "**no**")  # fmt: skip
        rows.append([key, *(cell(series(group, key, n)) for n in ("back", "to_enter", "to_ready")),
                     " / ".join(sorted(backs)), f"{sum(o.ok for o in mine)}/{len(mine)}",
                     ratio, target])  # fmt: skip
    return table(headers, rows, markdown)


def report(outcomes: Sequence[Outcome], machine: str, markdown: bool) -> None:
    print(f"machine: {machine}")
    groups: dict[tuple[int, str, str], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.nproc, o.fault, o.variant), []).append(o)
    for (nproc, fault, variant), group in groups.items():
        print(f"\n{nproc} GPU(s), fault {fault}, {variant}:\n")
        print(render(group, markdown))
    print("\nmedian (min-max) over the jobs that ended well; x peer: median (min-max) of run i "
          "/ run i; ranks back: after the fault (of them in a new process), per run.")  # fmt: skip
    for o in outcomes:
        if not o.ok:
            print(f"\nFAILED {o.nproc} GPU {o.fault}/{o.variant} {o.contender} run {o.run + 1}: "
                  f"{o.note}\n    " + o.tail[-4000:].replace("\n", "\n    "))  # fmt: skip


# ---- the machine and the raw results -------------------------------------------------------------


def machine_line(device: str) -> str:
    """GPU model and count, cores, torch and NVRx versions (asked of a child process)."""
    gpu = "0, 'CPU'"
    if device == "cuda":
        gpu = "torch.cuda.device_count(), torch.cuda.get_device_name()"
    code = f"import torch; print(torch.__version__, *({gpu}), sep='|')"
    said = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
    version, count, name = [*said.stdout.strip().split("|"), "?", "?", "?"][:3]
    try:
        nvrx = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        nvrx = "not installed"
    return f"{count} x {name}; {os.cpu_count()} cores; torch {version}; NVRx {nvrx}"


def write_json(path: Path, outcomes: Sequence[Outcome], machine: str, args: argparse.Namespace):
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()},
           "jobs": [dataclasses.asdict(o) for o in outcomes]}  # fmt: skip
    path.write_text(json.dumps(raw, indent=1))


def main() -> None:
    args = parse_args()
    if args.from_json:
        raws = [json.loads(p.read_text()) for p in args.from_json]
        outcomes = [Outcome(**job) for raw in raws for job in raw["jobs"]]
        machine = raws[0]["machine"]
    else:
        keys = list(args.contenders)
        nvrx = [k for k in keys if CONTENDERS[k].wrapper == "nvrx"]
        if nvrx and not nvrx_importable():
            progress(f"{', '.join(nvrx)} left out: `import nvidia_resiliency_ext` fails here")
            keys = [k for k in keys if k not in nvrx]
        take_charge()
        machine = machine_line(args.device)
        progress(f"machine: {machine}")
        path = args.json or args.out_dir / f"inprocess-{time.strftime('%Y%m%d-%H%M%S')}.json"
        outcomes = measure(args, keys, path, machine)
        progress(f"raw results: {path}")
    report(outcomes, machine, args.markdown)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
