"""The node's events file: its schema, declared once, for the writer and the readers alike.

`<log dir>/events-<node>.jsonl` holds one JSON object per line, the single source for
`ftrun report` and the benches. Every event has the common fields (`event`, `ts` wall clock for
people and for ordering across nodes, `mono` monotonic for durations within one node, `node`,
and `cycle`, the job-wide cycle number, equal on every node), plus the fields its kind lists in
`SCHEMA`. The writer (`EventLog`) and the reader (`ftrun.eventlog.reader`) both use `SCHEMA`, so an
event the agent writes is one the report can read.

Torch-free and cheap to import: `ftrun report` runs where training does not.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

EVENTS_GLOB = "events-*.jsonl"

# Field types, as JSON has them.
NUM = "number"
INT = "integer"
STR = "string"
LIST = "list"
BOOL = "boolean"
ANY = "any"


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of an event. A required field must be present with its type; an optional one
    may be missing or null. The reader rejects a line that lacks a required field."""

    name: str
    kind: str
    doc: str = ""
    required: bool = False


_req = functools.partial(Field, required=True)
_opt = Field


COMMON: tuple[Field, ...] = (
    _req("event", STR, "the kind, a key of SCHEMA"),
    _req("ts", NUM, "wall clock (time.time()) when written"),
    _req("mono", NUM, "monotonic clock of the writing node when written"),
    _req("node", STR, "the node's name"),
    _req("cycle", INT, "the job-wide cycle number"),
)

_PROGRESS_AT = "(wall clock, from the monitor's monotonic stamp)"

SCHEMA: Mapping[str, tuple[Field, ...]] = {
    "health_check": (
        _req("duration", NUM, "seconds the checks took, right before the rendezvous"),
        _opt("gpus", INT),
        _opt("storage_paths", INT),
        _opt("command", STR),
        _opt("ib_ports", INT),
    ),
    "rendezvous_done": (
        _req("duration", NUM, "seconds from joining to the round formed"),
        _req("group_rank", INT),
        _req("nodes", LIST, "node names of the round, in group-rank order"),
        _opt("world_size", INT),
        _opt("store_host", BOOL),
        _opt("standby", LIST, "nodes that arrived but stand by as hot spares"),
        _opt("stalled_cycles", INT, "cycles in a row just before this one without progress"),
    ),
    "standby": (
        _req("active", LIST, "the round's nodes; this one waits as a hot spare for a later cycle"),
    ),
    "control_request": (
        _req("rank", INT),
        _req("action", STR, "a WorkloadAction name"),
        _opt("description", STR),
    ),
    "workers_started": (
        _req("ranks", LIST, "global ranks of this node's workers"),
        _req("pids", LIST),
        _opt(
            "path", STR, "'forked' (from the fork server), 'spawned' (fresh interpreters), 'mixed'"
        ),
        _opt("why", STR, "why workers were spawned fresh, when any was"),
    ),
    "rank_startup": (
        _req("rank", INT),
        _req("pid", INT),
        _req("path", STR, "'forked' or 'spawned'"),
        _opt("to_script", NUM, "seconds from the workers' start to the script running (forked)"),
        _opt("to_cuda", NUM, "... to CUDA initialised in the rank (forked; null: not seen)"),
        _opt("to_pg", NUM, "... to init_process_group returned (forked; null: not seen)"),
        _opt("to_first_step", NUM, "... to the rank's first progress (null: none, no client)"),
    ),
    "stepping": (
        _req("ranks", LIST, "this node's ranks: every one has shown progress this cycle"),
        _req("progress_ts", NUM, f"the last of them to show its first progress {_PROGRESS_AT}"),
        _req("progress_mono", NUM, "the same moment on this node's monotonic clock"),
        _opt("iterations", LIST, "per rank (as `ranks`), the first iteration reported, or null"),
        _opt("startup", NUM, "seconds from the workers' start to `progress_mono`"),
    ),
    "last_progress": (
        _req("before", STR, "'stop': the workers are about to be stopped; 'finished': all done"),
        _req("ranks", LIST, "this node's ranks that registered with the monitor this cycle"),
        _opt("progress_ts", NUM, f"the latest progress of any of them {_PROGRESS_AT}; null: none"),
        _opt("progress_mono", NUM, "the same moment on this node's monotonic clock"),
        _opt("iterations", LIST, "per rank (as `ranks`), the latest iteration reported, or null"),
    ),
    "worker_exited": (
        _req("rank", INT),
        _req("code", INT, "the exit status; negative: killed by that signal"),
        _opt("local_rank", INT),
        _opt("pid", INT),
        _opt("signal", STR),
    ),
    "hang": (
        _req("rank", INT),
        _req("kind", STR, "a HangKind value"),
        _req("waited", NUM, "seconds without the awaited progress"),
        _opt("pid", INT),
        _opt("section", STR),
        _opt("timeout", NUM),
        _opt("detection_latency", NUM, "seconds from the deadline to the verdict"),
        _opt("stack_file", STR),
        _opt("where", STR),
        _opt("in_library", BOOL),
        _opt("stopped", BOOL, "the process was stopped (SIGSTOP, a debugger): others wait on it"),
    ),
    "failure": (
        _req("kind", STR, "the signature's kind (agent.diagnosis.attribution.Kind)"),
        _req("detail", STR, "what failed: an exception type, a CUDA/NCCL error, a signal..."),
        _req("key", STR, "what the restart policy compares across cycles and nodes"),
        _opt("where", STR, "the innermost frame of the user's code, when part of the key"),
        _opt("message", STR, "evidence: the exception's message, a reading"),
        _opt("secondary", BOOL, "a consequence of a failure elsewhere (a peer or the store lost)"),
        _opt("decision", STR, "the policy's: 'restart', 'exclude node' or 'stop job'"),
        _opt("reason", STR, "why, when the history decided it (or why a node stayed)"),
        _opt("rank", INT, "the rank that failed first, for a crash or a hang"),
    ),
    "health_finding": (
        _req("finding", STR, "what the health watch found while training"),
        _req("fault", BOOL, "a fault (acted on by --ft-health-action) or a degradation (logged)"),
        _opt("reading", STR),
        _opt("gpu", INT),
    ),
    "health_watch": (
        _req("polls", INT, "readings taken during the cycle"),
        _req("mean_us", NUM, "microseconds per reading (every GPU and port)"),
        _req("max_us", NUM),
    ),
    "collectives": (
        _req("summary", STR, "one line: who never entered which collective"),
        _req("op", STR),
        _req("seq", INT, "the collective's sequence number in its group"),
        _req("missing", LIST, "ranks that never entered it: the likely cause"),
        _req("entered", LIST, "ranks waiting inside it"),
        _opt("group", STR),
        _opt("sizes", STR),
        _opt("last_completed", INT, "the last collective every rank of the group completed"),
        _opt("no_dump", LIST, "ranks whose flight recorder did not answer"),
        _opt("nodes_answered", LIST),
        _opt("suspects", LIST, "the nodes of the missing ranks"),
    ),
    "rerun_suspect": (
        _req("rank", INT, "the rank whose rejected result reproduced in place"),
        _req("iteration", INT),
        _req("message", STR, "the validation's message (e.g. 'loss is NaN')"),
        _opt("result", STR),
    ),
    "rerun_verdict": (
        _req("diagnostic", STR, "transient_error, persistent_error or correct_result"),
        _req("rank", INT),
        _req("iteration", INT),
        _req("message", STR),
        _opt("initial", STR, "the rejected result"),
        _opt("rerun", STR, "the re-run's result"),
        _opt("suspect_node", STR, "the node whose result was rejected"),
        _opt("fatal", BOOL),
    ),
    "node_lost": (
        _req("nodes", LIST, "nodes of the cycle that did not come back and did not say why"),
        _req("lost_cycle", INT, "the cycle they were lost in (the event's own cycle is the next)"),
    ),
    "signal": (_req("signal", STR),),
    "store_lost": (_opt("error", STR),),
    "store_restarted": (),
    "stop_done": (
        _req("duration", NUM),
        _opt("killed", INT, "processes that needed SIGKILL"),
        _opt("survivors", INT),
        _opt("stopped", INT, "stopped processes sent SIGKILL at once, without the grace"),
    ),
    "gpu_memory_reclaimed": (_req("duration", NUM), _opt("released", BOOL), _opt("excess_mb", NUM)),
    "unhealthy": (_req("reason", STR),),
    "restart": (_opt("cause", STR),),
    "inprocess_recovered": (
        _req("iteration", INT, "the restart iteration that ended (the ranks go on with the next)"),
        _req("kind", STR, "EXCEPTION, SOFT_TIMEOUT, UNRESPONSIVE (a hang verdict), TERMINATED"),
        _opt("from_rank", INT, "the rank the fault came from (none: the agent's own verdict)"),
        _opt("why", STR),
        _opt("seconds", NUM, "from the fault to every rank ready at the iteration's barrier"),
    ),
    "inprocess_left": (
        _req("rank", INT),
        _req("iteration", INT),
        _opt("why", STR, "why the rank left"),
    ),
    "inprocess_gave_up": (
        _req("rank", INT),
        _req("iteration", INT),
        _opt("why", STR, "why in-process restart cannot cure it (the in-job restart follows)"),
    ),
    "rank_replaced": (
        _req("rank", INT, "a wrapped rank (ftrun.inprocess) whose process was lost"),
        _req("pid", INT, "its new process, which joins the others' next restart iteration"),
        _req("cause", STR),
    ),
    "ckpt_replicated": (
        _req("session", STR, "the checkpoint session (a directory of the node's keeper)"),
        _req("iteration", INT),
        _req("rank", INT, "the global rank that wrote the part"),
        _req("to", LIST, "the nodes that now hold a copy"),
        _req("bytes", INT, "the part's size"),
        _req("seconds", NUM, "from the first push to the last"),
        _opt("lag", NUM, "from the part's write to its last copy (the replicated tier's lag)"),
    ),
    "ckpt_held": (
        _req("session", STR),
        _req("iteration", INT, "the newest iteration this node now holds whole (local tier)"),
        _req("world_size", INT),
        _opt(
            "stall",
            NUM,
            "the longest time the latest save of one of this node's ranks "
            "blocked its training (seconds)",
        ),
    ),
    "ckpt_corrupt": (
        _req("session", STR),
        _req("iteration", INT),
        _req("rank", INT, "the global rank of the save"),
        _opt("world_size", INT),
    ),
    "ckpt_restore": (
        _req("session", STR),
        _req("iteration", INT, "what this node's ranks load; -1: nothing"),
        _req("world_size", INT),
        _req("fetched", INT, "parts this node fetched from peers"),
        _req("sources", LIST, "the nodes they came from"),
        _req("bytes", INT, "bytes fetched"),
        _req("seconds", NUM, "the whole agreement, fetches included, before the workers start"),
        _opt("attempts", INT, "fetch attempts (0: every node held its parts already)"),
    ),
    "straggler_report": (
        _req("seq", INT, "the report's number in its cycle (written by the reporting node)"),
        _req("ranks", INT, "ranks scored"),
        _req("worst", LIST, "[rank, node, lowest score of any kind] of the worst ranks"),
        _opt("median", NUM, "the median over every rank of its lowest score"),
    ),
    "straggler": (
        _req("seq", INT, "the report that found the stragglers"),
        _req("ranks", LIST),
        _req("nodes", LIST),
        _req("findings", LIST, "{rank, node, kind, section, score, threshold}, worst first"),
        _req("action", STR, "'log', 'stop' or 'exclude' (what the reporting node did)"),
        _opt("exclude", STR, "the node asked to leave"),
        _opt("note", STR, "why an exclusion was not possible"),
    ),
    "exit": (
        _req("code", INT),
        _opt("reason", STR, "the code's name"),
        _opt("why", STR, "the reason logged with it"),
    ),
}


_PYTHON_TYPES: Mapping[str, type | tuple[type, ...]] = {
    NUM: (int, float), INT: int, STR: str, LIST: list, BOOL: bool, ANY: object,
}  # fmt: skip


def has_type(value: Any, kind: str) -> bool:
    """Whether a JSON value has the schema type `kind` (true/false are not numbers)."""
    if kind not in _PYTHON_TYPES:
        raise ValueError(f"unknown field type {kind!r}")
    if isinstance(value, bool) and kind not in (BOOL, ANY):
        return False
    return isinstance(value, _PYTHON_TYPES[kind])


def problems(event: str, fields: Mapping[str, Any]) -> list[str]:
    """What is wrong with an event of kind `event` carrying `fields` (empty: nothing)."""
    spec = SCHEMA.get(event)
    if spec is None:
        return [f"unknown event kind {event!r}"]
    found = []
    for field in spec:
        value = fields.get(field.name)
        if value is None:
            if field.required:
                found.append(f"{event}: required field {field.name!r} missing")
        elif not has_type(value, field.kind):
            found.append(f"{event}: field {field.name!r} is not a {field.kind}: {value!r}")
    return found
