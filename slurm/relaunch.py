#!/usr/bin/env python3
"""Job relaunch policy for `slurm/ftrun.sbatch`: after each run, relaunch the job or stop.

One Slurm job runs `ft_launcher` once per node. When the launchers are done, the batch script
calls `relaunch.py finish`, which

1. reads each launcher's exit code (the template's task wrapper writes `exit-<SLURM_PROCID>`
   into the run directory; a launcher that left none counts as unknown),
2. asks Slurm whether it is ending the job itself (scancel, time limit reached),
3. `decide()`s: relaunch or stop (a pure function, unit-tested without Slurm),
4. relaunches: `sbatch` of the saved batch script (resubmit, the default) or
   `scontrol requeue` (requeue mode), and
5. appends one JSON line per run to `<job dir>/relaunches.jsonl` (job id, exit codes, decision);
   the relaunch count is the number of "relaunch" lines, so it survives every relaunch.

The batch script exits with the code this command exits with (0: training finished).

Standard library only: it runs under whatever `python3` the compute nodes have (FTRUN_PYTHON),
without ftrun installed. The exit codes below mirror `ftrun.errors.ExitCode` (a test checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# ftrun.errors.ExitCode, copied so that this script needs nothing but the standard library.
SUCCESS = 0
FAILED = 1  # restart budget spent in the job: a relaunch may help
USAGE = 2  # bad flag/config: a relaunch will not help
DO_NOT_RELAUNCH = 3  # the launcher says a relaunch is pointless
NO_PROGRESS = 4  # --ft-max-no-progress-cycles cycles in a row without progress: do not relaunch
EXCLUDED = 5  # this node left the job (a worker's request, a fault); the others' codes tell
REPEATED_FAILURE = 6  # the same failure on --ft-max-same-failure nodes: do not relaunch
RESUME_TO_DISAMBIGUATE = 16  # a rejected result must be re-run on other GPUs: relaunch
FAILED_ON_RESULT_VALIDATION = 17  # a rejected result reproduced elsewhere (fatal): stop
PREEMPTED = 75  # stopped by SIGTERM/SIGINT: relaunch me

HISTORY_FILE = "relaunches.jsonl"
# Slurm shows an unlimited job's TimeLimit as UNLIMITED, or as 365 days once it has a --signal.
_NO_LIMIT_S = 365 * 86400
SCONTROL_TIMEOUT_S = 30
# Which code a run reports when launchers disagree: a refusal to relaunch first, then a failure.
_SEVERITY = (DO_NOT_RELAUNCH, FAILED_ON_RESULT_VALIDATION, REPEATED_FAILURE, NO_PROGRESS, USAGE,
             FAILED, RESUME_TO_DISAMBIGUATE, PREEMPTED)  # fmt: skip
_REFUSALS = (DO_NOT_RELAUNCH, FAILED_ON_RESULT_VALIDATION, REPEATED_FAILURE, NO_PROGRESS, USAGE)
_CODE_NAMES = {
    SUCCESS: "success",
    FAILED: "restart budget spent",
    USAGE: "usage error",
    DO_NOT_RELAUNCH: "do not relaunch",
    NO_PROGRESS: "no progress",
    EXCLUDED: "node excluded",
    REPEATED_FAILURE: "the same failure on several nodes",
    RESUME_TO_DISAMBIGUATE: "re-run a rejected result elsewhere",
    FAILED_ON_RESULT_VALIDATION: "failed on result validation",
    PREEMPTED: "preempted",
}


class Action(str, enum.Enum):
    """What happens after a run: the job runs again, or the chain of runs ends here."""

    RELAUNCH = "relaunch"
    STOP = "stop"


class JobEnding(str, enum.Enum):
    """What Slurm is doing to the job while the batch script decides.

    RUNNING: the job is still running (the launchers ended by themselves, or after a SIGTERM
    notice such as `--signal=B:TERM@N` or `scancel --signal=TERM --batch`).
    TIME_LIMIT: Slurm is killing the job because its time limit is reached.
    CANCELLED: Slurm is killing the job for another reason (scancel, Slurm's own preemption or
    requeue, node failure): relaunching would undo a person's scancel or duplicate the job.
    """

    RUNNING = "running"
    TIME_LIMIT = "time_limit"
    CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome of one run: action, why, and the exit status for the batch script."""

    action: Action
    reason: str
    exit_code: int


_NO_RESTART_FLAGS = ("--ft-no-restart-exit-code", "--ft_no_restart_exit_code",
                     "--ft-no_restart_exit_code")  # fmt: skip


def no_restart_code(args: Sequence[str]) -> int | None:
    """The launchers' `--ft-no-restart-exit-code N` (NVRx's: their exit status for 4 and 6, a
    refusal to relaunch) in the batch script's arguments, `=N` or `N`; None if not given. The
    first wins: the launcher's options come before the script's arguments."""
    for index, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in _NO_RESTART_FLAGS:
            value = value if eq else "".join(args[index + 1 : index + 2])
            return int(value) if value.strip().isdigit() else None
    return None


def run_exit_code(
    codes: Sequence[int | None], finished: bool | None, no_restart: int | None = None
) -> int:
    """The batch script's exit status: 0 when finished, else the most telling launcher code.

    A missing code (launcher killed, node lost) counts as FAILED. Known codes rank by
    `_SEVERITY`, after `no_restart` (`--ft-no-restart-exit-code`); any other non-zero code
    (e.g. 137, killed by SIGKILL) comes after them.
    """
    if finished:
        return SUCCESS
    known = [FAILED if c is None else c for c in codes]
    for code in ((no_restart,) if no_restart else ()) + _SEVERITY:
        if code in known:
            return code
    return max(known, default=SUCCESS)


def _left_early(code: int | None) -> bool:
    """A code of a node that left a job that went on: lost, excluded or unhealthy."""
    return code is None or code < 0 or code >= 128 or code in (EXCLUDED, DO_NOT_RELAUNCH)


def _describe(codes: Sequence[int | None]) -> str:
    parts = []
    for code in sorted(set(codes), key=lambda c: -1 if c is None else c):
        n = sum(1 for c in codes if c == code)
        name = "no exit code" if code is None else f"{code} ({_CODE_NAMES.get(code, 'unknown')})"
        parts.append(f"{n}x {name}")
    return ", ".join(parts) or "no launcher ran"


def decide(
    codes: Sequence[int | None],
    finished: bool | None,
    relaunches_so_far: int,
    max_relaunches: int,
    ending: JobEnding = JobEnding.RUNNING,
    no_restart: int | None = None,
) -> Decision:
    """Relaunch or stop after one run of the job.

    codes: each launcher's exit code, None where a launcher left none.
    finished: whether the workload's "finished" flag file exists; None when no flag is used
    (then launchers that all exit 0 mean the training is done).
    relaunches_so_far: relaunches already made for this job (before this run ended).
    ending: what Slurm is doing to the job (see JobEnding).

    In order: finished -> stop; Slurm cancelling the job -> stop; no flag used, a launcher exited
    0 and the others 0 or as nodes that left on the way (lost: no code or killed; excluded;
    unhealthy) -> stop: a launcher exits 0 only once the job's workers all finished, and spares
    took those nodes' places; a launcher saying do-not-relaunch (3), no progress (4), the same
    failure (6), usage (2) or `no_restart` (`--ft-no-restart-exit-code`, standing for 4 and 6)
    -> stop; else (1, 75, unknown or missing codes, time limit, or success without the flag)
    relaunch while relaunches_so_far < max_relaunches.
    """
    code = run_exit_code(codes, finished, no_restart)
    if finished:
        return Decision(Action.STOP, "training finished (flag file present)", SUCCESS)
    if ending is JobEnding.CANCELLED:
        return Decision(Action.STOP, "Slurm is cancelling the job: not relaunching", code)
    if finished is None and SUCCESS in codes and all(_left_early(c) for c in codes if c):
        if all(c == SUCCESS for c in codes):
            return Decision(Action.STOP, "all launchers succeeded", SUCCESS)
        return Decision(Action.STOP, f"the job succeeded ({_describe(codes)})", SUCCESS)
    for refusal in ((no_restart,) if no_restart else ()) + _REFUSALS:
        if refusal in codes:
            why = _CODE_NAMES.get(refusal, "--ft-no-restart-exit-code: no progress or a failure "
                                  "restarting does not cure")  # fmt: skip
            return Decision(Action.STOP, f"a launcher exited {refusal} ({why})", refusal)
    if SUCCESS in codes:
        why = "the job succeeded but the finished flag is missing"
    elif ending is JobEnding.TIME_LIMIT:
        why = f"time limit reached ({_describe(codes)})"
    else:
        why = _describe(codes)
    if relaunches_so_far >= max_relaunches:
        budget = f"{relaunches_so_far} of {max_relaunches}"
        return Decision(Action.STOP, f"{why}; job relaunch budget spent ({budget})", code)
    return Decision(Action.RELAUNCH, why, code)


# ---- Slurm's view of the job ----------------------------------------------------------------

_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/-]*)=")


def parse_job_record(line: str) -> dict[str, str]:
    """One line of `scontrol show job -o` as a dict (values may contain '=', not ' Key=')."""
    keys = list(_KEY.finditer(line))
    record = {}
    for i, key in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        record[key.group(1)] = line[key.end() : end].strip()
    return record


def duration_s(text: str) -> float | None:
    """A Slurm duration in seconds; None for UNLIMITED and anything else unparsable.

    Slurm's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (scontrol prints H:M:S or D-H:M:S).
    """
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        return None
    days, *rest = match.groups()
    parts = [int(x) for x in rest if x is not None]
    if days is not None:  # D-H[:M[:S]]
        hours, minutes, seconds = [*parts, 0, 0][:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:  # M or M:S
        hours, (minutes, seconds) = 0, [*parts, 0][:2]
    return int(days or 0) * 86400.0 + hours * 3600 + minutes * 60 + seconds


def job_ending(record: Mapping[str, str]) -> JobEnding:
    """Is Slurm ending the job, and why? From `scontrol show job` of the job itself.

    While Slurm kills a job, scontrol shows it COMPLETING for scancel and time limit alike, so
    the time limit is told apart by the run time having reached it.
    """
    state = record.get("JobState", "RUNNING")
    if state == "RUNNING":
        return JobEnding.RUNNING
    run, limit = duration_s(record.get("RunTime", "")), duration_s(record.get("TimeLimit", ""))
    if state == "TIMEOUT" or (run is not None and limit is not None and run >= limit):
        return JobEnding.TIME_LIMIT
    return JobEnding.CANCELLED


def scontrol_job(job_id: str) -> dict[str, str]:
    """The job's record, or {} when scontrol cannot tell (then the job counts as running)."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"scontrol show job {job_id} failed: {exc}")
        return {}
    for line in proc.stdout.splitlines():
        record = parse_job_record(line)
        if record.get("JobId") == job_id:
            return record
    log(f"scontrol show job {job_id}: no record ({proc.stderr.strip()})")
    return {}


# ---- relaunching ----------------------------------------------------------------------------


def sbatch_argv(
    record: Mapping[str, str],
    script: str,
    args: Sequence[str],
    job_dir: str,
    extra: str = "",
) -> list[str]:
    """The `sbatch` command line that runs the job again.

    Slurm keeps no copy of the original sbatch command line, so the new job gets: the saved
    batch script (its #SBATCH lines apply again), the job's shape as Slurm recorded it (nodes,
    time limit, partition, account, QOS, name, working directory), then `extra`
    (FTRUN_SBATCH_ARGS, shell-quoted; later options win), then the same script arguments
    with the job dir pinned so that every run shares it.
    """
    argv = ["sbatch", "--parsable"]
    time_limit = record.get("TimeLimit", "")
    if (duration_s(time_limit) or 0) >= _NO_LIMIT_S:
        time_limit = ""  # "no limit" as Slurm shows it; a partition's MaxTime would reject it
    pinned = {
        "--nodes": record.get("NumNodes", ""),
        "--time": time_limit,
        "--partition": record.get("Partition", ""),
        "--account": record.get("Account", ""),
        "--qos": record.get("QOS", ""),
        "--job-name": record.get("JobName", ""),
        "--chdir": record.get("WorkDir", ""),
    }
    for flag, value in pinned.items():
        if value and value not in {"(null)", "UNLIMITED", "Partition_Limit", "NONE", "N/A"}:
            argv.append(f"{flag}={value}")
    argv += shlex.split(extra)
    return [*argv, script, f"--ft-job-dir={job_dir}", *args]


def sbatch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for the inner sbatch: this job's SLURM_* output variables removed.

    sbatch exports its environment to the new job (--export=ALL by default); stale values of
    this job (SLURM_JOB_ID, SLURM_RESTART_COUNT, ...) must not leak into it. SLURM_CONF stays.
    """
    return {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def resubmit(argv: Sequence[str]) -> tuple[str | None, str]:
    """Run sbatch; returns (new job id, error text)."""
    try:
        proc = subprocess.run(
            list(argv),
            env=sbatch_env(os.environ),
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if proc.returncode != 0:
        return None, proc.stderr.strip() or f"sbatch exited {proc.returncode}"
    return proc.stdout.strip().split(";")[0], ""


def requeue(job_id: str) -> str:
    """`scontrol requeue` this job; returns an error text, "" on success.

    Slurm then kills this batch script (SIGTERM, KillWait, SIGKILL) and starts the same job id
    again after BeginTime (cred_expire + 1 s: ~2 min on a default cluster).
    """
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job_id],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


# ---- the job directory ----------------------------------------------------------------------


def read_history(job_dir: Path) -> list[dict]:
    """Every run recorded so far; a torn last line (writer killed) is skipped."""
    path = job_dir / HISTORY_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def relaunch_count(history: Sequence[Mapping]) -> int:
    return sum(1 for r in history if r.get("decision") == Action.RELAUNCH.value)


def append_history(job_dir: Path, record: Mapping) -> None:
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    with (job_dir / HISTORY_FILE).open("a+b") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a writer was killed mid-line: keep that torn line apart
                line = b"\n" + line
        f.write(line)  # append mode: always at the end
        f.flush()
        os.fsync(f.fileno())  # the next run, maybe on another node, must see it


def read_codes(run_dir: Path | None, nodes: int) -> tuple[list[int | None], list[str | None]]:
    """Exit codes and node names of launchers 0..nodes-1 from `exit-<procid>` files."""
    codes: list[int | None] = [None] * nodes
    names: list[str | None] = [None] * nodes
    for procid in range(nodes):
        path = run_dir / f"exit-{procid}" if run_dir else None
        if path is None or not path.exists():
            continue
        fields = path.read_text(encoding="utf-8").split()
        if fields and fields[0].lstrip("-").isdigit():
            codes[procid] = int(fields[0])
            names[procid] = fields[1] if len(fields) > 1 else None
    return codes, names


# ---- the CLI --------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"ftrun relaunch: {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    finish = sub.add_parser("finish", help="record this run, then relaunch the job or stop")
    finish.add_argument("--job-dir", type=Path, required=True)
    finish.add_argument("--run-dir", type=Path, help="where launchers wrote exit-<procid>")
    finish.add_argument("--nodes", type=int, required=True, help="launchers started (1/node)")
    finish.add_argument("--srun-rc", type=int, default=None)
    finish.add_argument("--max-relaunches", type=int, required=True)
    finish.add_argument("--finished-flag", default="", help="file; empty: no flag is used")
    finish.add_argument("--mode", choices=("resubmit", "requeue"), default="resubmit")
    finish.add_argument("--script", required=True, help="batch script to resubmit")
    finish.add_argument("--started", type=float, default=None, help="run start, epoch s")
    finish.add_argument("args", nargs=argparse.REMAINDER, help="-- the script's arguments")
    ns = parser.parse_args(argv)
    if ns.args[:1] == ["--"]:
        ns.args = ns.args[1:]
    return ns


def finish(ns: argparse.Namespace, environ: Mapping[str, str]) -> int:
    job_id = environ.get("SLURM_JOB_ID", "")
    history = read_history(ns.job_dir)
    codes, names = read_codes(ns.run_dir, ns.nodes)
    flag = Path(ns.finished_flag) if ns.finished_flag else None
    finished = flag.exists() if flag else None
    record = scontrol_job(job_id) if job_id else {}
    ending = job_ending(record) if record else JobEnding.RUNNING
    so_far = relaunch_count(history)
    no_restart = no_restart_code([*shlex.split(environ.get("FTRUN_LAUNCHER", "")), *ns.args])
    decision = decide(codes, finished, so_far, ns.max_relaunches, ending, no_restart)
    entry = {
        "run": len(history),
        "job_id": job_id,
        "restart_count": int(environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "nodes": names,
        "codes": codes,
        "srun_rc": ns.srun_rc,
        "finished": finished,
        "ending": ending.value,
        "decision": decision.action.value,
        "reason": decision.reason,
        "exit_code": decision.exit_code,
        "relaunches": so_far,
        "max_job_relaunches": ns.max_relaunches,
        "mode": ns.mode,
        "started": ns.started,
        "ended": round(time.time(), 3),
    }
    if decision.action is Action.RELAUNCH:
        entry = _relaunch(ns, entry, record, job_id)
    else:
        append_history(ns.job_dir, entry)
    log(f"run {entry['run']} (job {job_id}): {entry['decision']}: {entry['reason']}")
    return decision.exit_code


def _relaunch(ns: argparse.Namespace, entry: dict, record: Mapping[str, str], job_id: str) -> dict:
    """Relaunch, then record the run; a relaunch that fails is recorded as a stop."""
    entry = {**entry, "relaunches": entry["relaunches"] + 1}
    if ns.mode == "requeue":
        # Recorded first: Slurm kills this script as soon as the requeue is accepted.
        append_history(ns.job_dir, {**entry, "next_job_id": job_id})
        error = requeue(job_id)
        if not error:
            return {**entry, "next_job_id": job_id}
        failed = {**entry, "decision": Action.STOP.value, "reason": f"requeue failed: {error}"}
        append_history(ns.job_dir, {**failed, "relaunches": entry["relaunches"] - 1})
        return failed
    argv = sbatch_argv(
        record, ns.script, ns.args, str(ns.job_dir), os.environ.get("FTRUN_SBATCH_ARGS", "")
    )
    log(f"resubmitting: {shlex.join(argv)}")
    new_id, error = resubmit(argv)
    if new_id:
        entry = {**entry, "next_job_id": new_id}
    else:
        reason = f"{entry['reason']}; resubmit failed: {error}"
        entry = {
            **entry,
            "decision": Action.STOP.value,
            "reason": reason,
            "relaunches": entry["relaunches"] - 1,
        }
    append_history(ns.job_dir, entry)
    return entry


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    if ns.command == "finish":
        return finish(ns, os.environ)
    return USAGE


if __name__ == "__main__":
    sys.exit(main())
