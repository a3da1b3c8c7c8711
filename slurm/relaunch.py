#!/usr/bin/env python3
"""Job relaunch policy for `slurm/ftrun.sbatch`: after each run, relaunch the job or stop.

One Slurm job runs `ft_launcher` once per node. When the launchers are done, the batch script
calls `relaunch.py finish`, which

1. reads each launcher's exit code (the template's task wrapper writes `exit-<SLURM_PROCID>`
   into the run directory; a launcher that left none counts as unknown),
2. asks Slurm whether it is ending the job itself (scancel, time limit reached),
3. `decide()`s: relaunch or stop (a pure function, unit-tested without Slurm),
4. relaunches: `sbatch` of the saved batch script (resubmit, the default) or
   `scontrol requeue` (requeue mode), keeping the nodes the agents judged unhealthy out of
   the next job (`--exclude`; see "excluding unhealthy nodes" below), and
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
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
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
EXCLUDED_FILE = "excluded-nodes"  # the nodes kept out of the next jobs: "<node> <why>" lines
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


_LOG_DIR_FLAGS = ("--log-dir", "--log_dir")


def launcher_option(args: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the first of `flags` in the batch script's arguments (`=V` or `V`); None
    if not given. The first wins: the launcher's options come before the script's arguments."""
    for index, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            return value if eq else "".join(args[index + 1 : index + 2])
    return None


def no_restart_code(args: Sequence[str]) -> int | None:
    """The launchers' `--ft-no-restart-exit-code N` (NVRx's: their exit status for 4 and 6, a
    refusal to relaunch) in the batch script's arguments; None if not given."""
    value = launcher_option(args, _NO_RESTART_FLAGS)
    return int(value) if value is not None and value.strip().isdigit() else None


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


# ---- excluding unhealthy nodes --------------------------------------------------------------
#
# A node the agents judged unhealthy is kept out of every later job of the chain. Its launcher's
# events say so: `unhealthy` (its health check failed; it exits 3) or `exit` with 5 (it left
# the job on a verdict about it: a health finding, the same failure repeated on it, a straggler,
# a worker's ExcludeThisNode). The verdicts accumulate in <job dir>/excluded-nodes, oldest
# first, and each relaunch hands them to Slurm (`sbatch --exclude`, or `scontrol update
# ExcNodeList` of the requeued job). NVRx 0.7's scheduler exclusion keeps a Slurm array task
# whose nodes Slurm marked down or drained out of the rendezvous; here the agents' own verdict
# keeps the node out of the next allocation.


@dataclasses.dataclass(frozen=True)
class Exclusion:
    """The nodes the next job is kept off.

    judged: nodes the agents judged unhealthy (this run or earlier), newest verdict first.
    own: the job's own `--exclude` (Slurm's ExcNodeList less `judged` of the last run): kept.
    let_in: judged nodes let back in, because keeping them out leaves too few nodes; note
    says so in one line.
    """

    judged: tuple[str, ...] = ()
    own: tuple[str, ...] = ()
    let_in: tuple[str, ...] = ()
    note: str = ""

    @property
    def slurm_list(self) -> str:
        """The value for `--exclude` / ExcNodeList ("" clears it)."""
        return ",".join(dict.fromkeys(self.own + self.judged))


def node_verdicts(events: Iterable[Mapping], since: float | None = None) -> dict[str, str]:
    """Node -> why, for every node the launchers' events judge unhealthy (at `since` or later:
    a --log-dir shared by the runs holds the earlier runs' events too)."""
    found: dict[str, str] = {}
    for event in events:
        node, ts = event.get("node"), event.get("ts")
        if not isinstance(node, str) or not node:
            continue
        if since is not None and isinstance(ts, (int, float)) and ts < since:
            continue
        if event.get("event") == "unhealthy":
            found.setdefault(node, f"unhealthy: {event.get('reason') or '?'}")
        elif event.get("event") == "exit" and event.get("code") == EXCLUDED:
            found.setdefault(node, f"excluded: {event.get('why') or event.get('reason') or '?'}")
    return found


def merge_verdicts(
    kept: Sequence[tuple[str, str]], new: Mapping[str, str]
) -> list[tuple[str, str]]:
    """The excluded-nodes list after a run, oldest first: a node judged again moves to the end."""
    return [(node, why) for node, why in kept if node not in new] + list(new.items())


def plan_exclusion(
    judged: Sequence[str], own: Sequence[str], pool: Sequence[str] | None, needed: int,
    partition: str = "",
) -> Exclusion:  # fmt: skip
    """Which judged nodes (oldest first) the next job is kept off, so that it can still run.

    pool: the nodes the job may run on (its partition's; None: unknown, keep every verdict).
    The newest verdicts are kept while the pool, less the job's own exclusions and the nodes
    kept out, still has `needed` nodes; the older ones are let back in: a job that excludes
    more nodes than the partition can spare would pend forever.
    """
    own_set = set(own)
    left = None if pool is None else [n for n in dict.fromkeys(pool) if n not in own_set]
    kept: list[str] = []
    let_in: list[str] = []
    for node in reversed(list(dict.fromkeys(judged))):
        if node in own_set:
            continue
        if left is None or node not in left or len(left) > needed:
            kept.append(node)
            if left is not None and node in left:
                left.remove(node)
        else:
            let_in.append(node)
    note = ""
    if let_in and pool is not None:
        everyone = ",".join(sorted(set(kept) | set(let_in)))
        short = len(left or ()) - len(let_in)
        where = f"partition {partition}'s" if partition else "the cluster's"
        which = " (the oldest verdicts)" if kept else ""
        note = (f"excluding {everyone} would leave {short} of {where} {len(set(pool))} nodes "
                f"for a {needed}-node job: not excluding {','.join(let_in)}{which}")  # fmt: skip
    return Exclusion(tuple(kept), tuple(own), tuple(let_in), note)


def waive_excluded(
    codes: Sequence[int | None], names: Sequence[str | None], verdicts: Mapping[str, str],
    excluded: Sequence[str],
) -> list[int | None]:  # fmt: skip
    """The codes `decide` sees: a 3 (do not relaunch) from a node judged unhealthy in this run
    that the next job is kept off reads as 5 (a node that left): excluding it is the cure the
    3 said a relaunch lacked. A 3 from elsewhere (a ShutdownWorkload) still stops the chain."""
    out = set(excluded)
    waived = [i for i, name in enumerate(names) if name in verdicts and name in out]
    return [EXCLUDED if code == DO_NOT_RELAUNCH and i in waived else code
            for i, code in enumerate(codes)]  # fmt: skip


def needed_nodes(record: Mapping[str, str], default: int) -> int:
    """The job's node count from Slurm's NumNodes ("2", or "2-4": the minimum)."""
    match = re.match(r"\d+", record.get("NumNodes", ""))
    return int(match.group()) if match else default


# ---- Slurm's view of the job ----------------------------------------------------------------

_UNSET = frozenset({"(null)", "UNLIMITED", "Partition_Limit", "NONE", "N/A"})
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


def _client(argv: Sequence[str]) -> tuple[str | None, str]:
    """Run a Slurm client; (its stdout, "") or (None, why it failed)."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if proc.returncode != 0:
        return None, proc.stderr.strip() or f"{argv[0]} exited {proc.returncode}"
    return proc.stdout, ""


def hostnames(hostlist: str) -> list[str]:
    """Slurm's hostlist (n[1-3],m5) as node names (`scontrol show hostnames`)."""
    if not hostlist or hostlist in _UNSET:
        return []
    if not re.search(r"[\[\]]", hostlist):
        return [name for name in hostlist.split(",") if name]
    out, error = _client(["scontrol", "show", "hostnames", hostlist])
    if out is None:
        log(f"scontrol show hostnames {hostlist} failed: {error}")
        return [name for name in re.split(r",(?![^\[]*\])", hostlist) if name]
    return out.split()


def partition_nodes(partition: str) -> list[str] | None:
    """The nodes of the job's partition (`sinfo -N`); None when sinfo cannot tell."""
    where = ["--partition", partition] if partition and partition not in _UNSET else []
    out, error = _client(["sinfo", "--noheader", "--Node", "--format=%N", *where])
    if out is None:
        log(f"sinfo failed ({error}): excluding every node judged unhealthy")
        return None
    return list(dict.fromkeys(out.split()))


def set_excluded_nodes(job_id: str, slurm_list: str) -> str:
    """`scontrol update ExcNodeList` of a pending job (a running one refuses); error or ""."""
    out, error = _client(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={slurm_list}"])
    return "" if out is not None else error


# ---- relaunching ----------------------------------------------------------------------------


def sbatch_argv(
    record: Mapping[str, str],
    script: str,
    args: Sequence[str],
    job_dir: str,
    extra: str = "",
    exclude: str = "",
) -> list[str]:
    """The `sbatch` command line that runs the job again.

    Slurm keeps no copy of the original sbatch command line, so the new job gets: the saved
    batch script (its #SBATCH lines apply again), the job's shape as Slurm recorded it (nodes,
    time limit, partition, account, QOS, name, working directory), then `extra`
    (FTRUN_SBATCH_ARGS, shell-quoted; later options win) with its `--exclude` merged into
    `exclude` (`Exclusion.slurm_list`), then the same script arguments with the job dir pinned
    so that every run shares it.
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
        if value and value not in _UNSET:
            argv.append(f"{flag}={value}")
    rest, theirs = take_exclude(shlex.split(extra))
    merged = ",".join(x for x in (*theirs, exclude) if x)
    argv += [*rest, *([f"--exclude={merged}"] if merged else [])]
    return [*argv, script, f"--ft-job-dir={job_dir}", *args]


def take_exclude(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """sbatch options less their `--exclude`/`-x` (which a later one would replace), and those
    values."""
    rest: list[str] = []
    values: list[str] = []
    it = iter(tokens)
    for token in it:
        if token in ("--exclude", "-x"):
            values.append(next(it, ""))
        elif token.startswith("--exclude="):
            values.append(token.partition("=")[2])
        elif token.startswith("-x") and not token.startswith("--"):
            values.append(token[2:])
        else:
            rest.append(token)
    return rest, values


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


def read_events(log_dir: Path) -> list[dict]:
    """The launchers' `unhealthy` and `exit` events from `<log dir>/events-<node>.jsonl`."""
    events = []
    for path in sorted(log_dir.glob("events-*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as exc:
            log(f"cannot read {path}: {exc}")
            continue
        for line in lines:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a launcher killed while writing it
            if isinstance(event, dict) and event.get("event") in ("unhealthy", "exit"):
                events.append(event)
    return events


_EXCLUDED_HEADER = """\
# Nodes the agents judged unhealthy: every relaunch of this job is kept off them (sbatch
# --exclude; scontrol update ExcNodeList in requeue mode). "<node> <why>", oldest first.
# Delete a node's line (or this file) to let it back into the next relaunch.
"""


def read_excluded(job_dir: Path) -> list[tuple[str, str]]:
    path = job_dir / EXCLUDED_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    entries = [line.strip().partition(" ") for line in lines]
    return [(node, why.strip()) for node, _, why in entries if node and not node.startswith("#")]


def write_excluded(job_dir: Path, entries: Sequence[tuple[str, str]]) -> None:
    """Replace the excluded-nodes file at once (a reader never sees half of it)."""
    text = _EXCLUDED_HEADER + "".join(f"{node} {' '.join(why.split())}\n" for node, why in entries)
    tmp = job_dir / f".{EXCLUDED_FILE}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, job_dir / EXCLUDED_FILE)


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
    verdicts = judged_in_run(ns, names)
    exclusion = exclusion_for(ns, record, history, verdicts)
    seen = waive_excluded(codes, names, verdicts, exclusion.judged)
    decision = decide(seen, finished, so_far, ns.max_relaunches, ending, no_restart)
    reason = decision.reason
    if decision.action is Action.RELAUNCH and exclusion.judged:
        reason += f"; the next job excludes {','.join(exclusion.judged)} (judged unhealthy)"
    stuck = [node for node in exclusion.let_in if node in verdicts]
    if decision.action is Action.STOP and stuck:
        reason += f"; {','.join(stuck)} judged unhealthy, too few nodes to exclude"
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
        "reason": reason,
        "exit_code": decision.exit_code,
        "relaunches": so_far,
        "max_job_relaunches": ns.max_relaunches,
        "mode": ns.mode,
        "unhealthy": verdicts,
        "exclude": list(exclusion.judged),
        "started": ns.started,
        "ended": round(time.time(), 3),
    }
    if decision.action is Action.RELAUNCH:
        entry = _relaunch(ns, entry, record, job_id, exclusion)
    else:
        append_history(ns.job_dir, entry)
    log(f"run {entry['run']} (job {job_id}): {entry['decision']}: {entry['reason']}")
    return decision.exit_code


def judged_in_run(ns: argparse.Namespace, names: Sequence[str | None]) -> dict[str, str]:
    """This run's verdicts, node -> why, from the launchers' events; logged one a line.

    The events are under the template's `--log-dir=<run dir>/logs`, or the first `--log-dir`
    of the launcher options (then the runs may share it: only events since this run started).
    A name that is not one of this job's nodes (`--ft-node-name`) cannot be excluded."""
    given = launcher_option(ns.args, _LOG_DIR_FLAGS)
    log_dir = Path(given) if given else ns.run_dir / "logs" if ns.run_dir else None
    if log_dir is None or not log_dir.is_dir():
        return {}
    verdicts = node_verdicts(read_events(log_dir), ns.started if given else None)
    known = {name for name in names if name}
    for node in sorted(set(verdicts) - known if known else ()):
        log(f"{node} judged unhealthy, but it is no node of this job: not excluded")
        del verdicts[node]
    for node, why in verdicts.items():
        log(f"{node} judged unhealthy in this run: {why}")
    return verdicts


def exclusion_for(
    ns: argparse.Namespace, record: Mapping[str, str], history: Sequence[Mapping],
    verdicts: Mapping[str, str],
) -> Exclusion:  # fmt: skip
    """The nodes the next job is kept off; this run's verdicts join `<job dir>/excluded-nodes`.

    The job's own exclusions are Slurm's ExcNodeList less the nodes the last run added."""
    kept = read_excluded(ns.job_dir)
    if verdicts:
        kept = merge_verdicts(kept, verdicts)
        write_excluded(ns.job_dir, kept)
    added = set(history[-1].get("exclude") or ()) if history else set()
    own = tuple(n for n in hostnames(record.get("ExcNodeList", "")) if n not in added)
    if not kept:
        return Exclusion(own=own)
    judged = [node for node, _ in kept]
    # A requeued job keeps its --nodelist: a node it requires and excludes would never start.
    required = set(hostnames(record.get("ReqNodeList", ""))) if ns.mode == "requeue" else set()
    if required & set(judged):
        log(f"not excluding {','.join(sorted(required & set(judged)))}: the job requires it "
            "(--nodelist), and requeue keeps that")  # fmt: skip
    partition = record.get("Partition", "")
    needed = needed_nodes(record, ns.nodes)
    plan = plan_exclusion([n for n in judged if n not in required], own,
                          partition_nodes(partition), needed, partition)  # fmt: skip
    if plan.note:
        log(plan.note)
    lost = tuple(n for n in judged if n in required)
    return dataclasses.replace(plan, let_in=plan.let_in + lost) if lost else plan


def _relaunch(
    ns: argparse.Namespace, entry: dict, record: Mapping[str, str], job_id: str,
    exclusion: Exclusion,
) -> dict:  # fmt: skip
    """Relaunch, then record the run; a relaunch that fails is recorded as a stop."""
    entry = {**entry, "relaunches": entry["relaunches"] + 1}
    if ns.mode == "requeue":
        return _requeue(ns, entry, record, job_id, exclusion)
    argv = sbatch_argv(record, ns.script, ns.args, str(ns.job_dir),
                       os.environ.get("FTRUN_SBATCH_ARGS", ""), exclusion.slurm_list)  # fmt: skip
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


def _requeue(
    ns: argparse.Namespace, entry: dict, record: Mapping[str, str], job_id: str,
    exclusion: Exclusion,
) -> dict:  # fmt: skip
    """`scontrol requeue`, then the job's ExcNodeList where it changes: Slurm takes it only
    once the job is pending again, and meanwhile sends this script SIGTERM (then SIGKILL after
    KillWait), so SIGTERM is ignored from here on."""
    # Recorded first: Slurm kills this script as soon as the requeue is accepted.
    append_history(ns.job_dir, {**entry, "next_job_id": job_id})
    change = set(hostnames(record.get("ExcNodeList", ""))) != {*exclusion.own, *exclusion.judged}
    if change:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    error = requeue(job_id)
    if not error:
        if change:
            failed = set_excluded_nodes(job_id, exclusion.slurm_list)
            done = f"could not set ExcNodeList: {failed}" if failed else "ExcNodeList set"
            log(f"requeued job {job_id}: {done} ({exclusion.slurm_list or 'none'})")
        return {**entry, "next_job_id": job_id}
    failed = {**entry, "decision": Action.STOP.value, "reason": f"requeue failed: {error}"}
    append_history(ns.job_dir, {**failed, "relaunches": entry["relaunches"] - 1})
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    if ns.command == "finish":
        return finish(ns, os.environ)
    return USAGE


if __name__ == "__main__":
    sys.exit(main())
