"""Failure signatures: what one failure looks like, named the same way every time it recurs.

Pure: text in, `Signature` out. The agent collects the evidence while a cycle ends (the exit
status, the tail of the failed rank's stderr, a hung rank's stacks, a health finding, a node
that did not come back) and one of the `*_signature` functions names it. The restart policy
compares signatures (`Signature.key`) across cycles and nodes; the report prints them.

What goes in the key, and why:
- a Python exception: its type and the innermost frame of the user's code (a bug is a place
  in the code; the message often carries a rank, an iteration or a size that differ each time);
- a CUDA or NCCL error: the error text, normalised (the frame where an asynchronous error
  surfaces varies, the error does not);
- a signal: its name, and the innermost user frame when faulthandler printed one;
- a hang: its kind and section, and where the rank was stuck (or that its process was stopped);
- a health finding or a lost node: what was found.

Some failures are the *consequence* of another: a collective whose peer died (gloo "Connection
closed by peer", NCCL "remote process exited"), a store connection reset when the store's host
died. Those are `secondary`: the restart still happens, but the policy does not count them
against the node, and the report looks for the failure that caused them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
from collections.abc import Sequence

from ftrun.rank_monitor.stacks import StuckAt, is_library, where_stuck

STDERR_TAIL_BYTES = 64 * 1024
"""How much of a failed rank's stderr the agent reads (the end: the traceback is last)."""

_TRACEBACK = "Traceback (most recent call last):"
# Python's traceback lines ('File "x", line 3, in f') and faulthandler's ('File "x", line 3 in f').
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)?)"
                        r"(?::\s?(?P<message>.*))?$")  # fmt: skip
_FATAL = re.compile(r"^Fatal Python error: (?P<what>.+)$")
_NCCL_RESULT = re.compile(r"NCCL error[^,]*,\s*(?P<what>[^(\n]+?)\s*(?:\(|, NCCL version|$)")
_CUDA_ERROR = re.compile(r"CUDA error: (?P<what>[^\n]+)")
_MESSAGE_CHARS = 240
# torch prefixes each line of a rank's uncaught traceback with "[rank3]:".
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.MULTILINE)

# Text that marks a failure as the consequence of another one (a peer or the store went away).
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "Socket Timeout",
    "Broken pipe",
)
STOPPED = "process stopped"
"""Ends the detail of a hang whose process was stopped (SIGSTOP, a debugger)."""
_STOPPED_WHY = "no stacks: it was stopped (SIGSTOP or a debugger) and acts on nothing but SIGKILL"
_COLLECTIVE_TIMEOUT = ("Watchdog caught collective operation timeout", "Timed out waiting")


class Kind:
    """Signature kinds (strings, as they appear in events and `failures.jsonl`)."""

    EXCEPTION = "exception"
    CUDA = "cuda"
    NCCL = "nccl"
    SIGNAL = "signal"
    EXIT = "exit"
    HANG = "hang"
    COLLECTIVE = "collective"
    HEALTH = "health"
    PEER_LOST = "peer lost"


@dataclasses.dataclass(frozen=True)
class Signature:
    """One failure, named so that its recurrences compare equal (`key`)."""

    kind: str
    detail: str
    """What failed: an exception type, a normalised CUDA/NCCL error, a signal name, ..."""
    where: str = ""
    """The innermost frame of the user's code (`train.py:42 in step`), when it is part of the
    failure's identity."""
    message: str = ""
    """Evidence only (never compared): the exception's message, the finding's reading."""
    secondary: bool = False
    """The consequence of a failure elsewhere: not counted against this node."""
    rank: int | None = None
    """Evidence only: the rank it happened on (a crash, a hang), when there is one."""

    @property
    def key(self) -> str:
        return f"{self.kind}: {self.detail}" + (f" at {self.where}" if self.where else "")

    def describe(self) -> str:
        text = self.key
        if self.message:
            text += f" ({self.message})"
        return text + (" [a consequence of a failure elsewhere]" if self.secondary else "")

    def as_dict(self) -> dict[str, object]:
        """The event's fields: empty and None ones left out."""
        fields = dataclasses.asdict(self) | {"key": self.key}
        return {name: value for name, value in fields.items() if value not in ("", None)}


def exit_signature(returncode: int, stderr_tail: str, rank: int | None = None) -> Signature:
    """A worker (`rank`) that ended on its own with `returncode` (negative: that signal)."""
    return dataclasses.replace(_exit(returncode, _RANK_PREFIX.sub("", stderr_tail)), rank=rank)


def _exit(returncode: int, stderr_tail: str) -> Signature:
    error = last_exception(stderr_tail)
    if error is not None:
        return error
    fatal = _fatal_error(stderr_tail)
    if returncode < 0:
        name = signal_name(-returncode)
        if fatal is not None:
            return dataclasses.replace(fatal, kind=Kind.SIGNAL, detail=name)
        hint = "the kernel's OOM killer or a person" if -returncode == signal.SIGKILL else ""
        return Signature(Kind.SIGNAL, name, message=hint)
    if fatal is not None:
        return fatal
    return Signature(Kind.EXIT, f"exit code {returncode}", message=_last_line(stderr_tail))


def last_exception(text: str) -> Signature | None:
    """The last Python traceback in `text` as a signature; None if there is none."""
    start = text.rfind(_TRACEBACK)
    if start < 0:
        return None
    lines = text[start:].splitlines()[1:]
    frames, index = [], 0
    while index < len(lines) and (lines[index].startswith(" ") or not lines[index].strip()):
        if match := _FRAME.match(lines[index]):
            frames.append(match)
        index += 1
    body = "\n".join(lines[index:])
    head = _EXCEPTION.match(lines[index].strip()) if index < len(lines) else None
    if head is None:
        return None
    exc_type, message = head["type"], (head["message"] or "").strip()
    return _classify(exc_type, message, body, _innermost_user(frames))


def _classify(exc_type: str, message: str, body: str, where: str) -> Signature:
    short = _clip(message)
    if any(text in body for text in _PEER_LOST):
        return Signature(Kind.PEER_LOST, exc_type, message=short, secondary=True)
    if any(text in body for text in _COLLECTIVE_TIMEOUT):
        return Signature(Kind.COLLECTIVE, "collective timed out", message=short, secondary=True)
    if "CUDA out of memory" in body:
        return Signature(Kind.CUDA, "CUDA out of memory", message=short)
    if "NCCL error" in body or "ncclUnhandled" in body or "ncclInvalid" in body:
        match = _NCCL_RESULT.search(body)
        what = match["what"].strip() if match else exc_type
        return Signature(Kind.NCCL, f"NCCL error: {what}", message=short)
    if match := _CUDA_ERROR.search(body):
        return Signature(Kind.CUDA, f"CUDA error: {match['what'].strip()}", message=short)
    return Signature(Kind.EXCEPTION, exc_type, where=where, message=short)


def _fatal_error(text: str) -> Signature | None:
    """faulthandler's report of a fatal signal (SIGSEGV, SIGABRT, ...), with the user's frame."""
    lines = text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        if match := _FATAL.match(lines[index]):
            stuck = where_stuck("\n".join(lines[index:]))
            where = ""
            if stuck is not None:
                where = (stuck.caller if stuck.in_library else stuck.frame) or ""
            return Signature(Kind.EXIT, match["what"].strip(), where=where)
    return None


def hang_signature(
    kind: str,
    section: str | None,
    stuck: StuckAt | None,
    rank: int | None = None,
    stopped: bool = False,
) -> Signature:
    """A rank judged hung (`HangKind` value), from where its stack dump shows it stuck
    (`Verdict.stuck`; None: no readable dump); a `stopped` one has none."""
    detail = f"{kind} in section {section!r}" if section else kind
    if stopped:
        return Signature(Kind.HANG, f"{detail}, {STOPPED}", message=_STOPPED_WHY, rank=rank)
    if stuck is None:
        return Signature(Kind.HANG, detail, message="no stack dump", rank=rank)
    where = stuck.caller if stuck.in_library else stuck.frame
    message = stuck.describe() if stuck.in_library else ""
    return Signature(Kind.HANG, detail, where=where or "", message=message, rank=rank)


def hang_cause(signatures: Sequence[Signature]) -> Signature:
    """The one signature of a hang whose ranks were judged together (`hang_signature`s): the
    waiting ranks miss their heartbeats too, so the cause is a stopped rank's (it can do
    nothing; the others wait for it), else a rank stuck in its own code, else the first, marked
    `secondary`: all wait inside libraries, for someone the flight recorders may name."""
    stopped = [s for s in signatures if s.detail.endswith(STOPPED)]
    own_code = [s for s in signatures if s.where and not s.message]
    if stopped or own_code:
        return (stopped or own_code)[0]
    return dataclasses.replace(signatures[0], secondary=True)


def collective_signature(op: str, seq: int, missing: list[int]) -> Signature:
    """A hang whose flight-recorder dumps show ranks that never entered collective `seq`."""
    ranks = ", ".join(str(r) for r in missing)
    return Signature(Kind.COLLECTIVE, f"{op} not entered", message=f"seq {seq}, ranks {ranks}")


def health_signature(finding: str, reading: str = "") -> Signature:
    return Signature(Kind.HEALTH, finding, message=reading)


def _innermost_user(frames: list[re.Match[str]]) -> str:
    for match in reversed(frames):
        path = match["path"]
        if not is_library(path):
            return f"{os.path.basename(path)}:{match['line']} in {match['func']}"
    return ""


_NVRX_STOP_SIGNALS = {"SIGSEGV": "a segmentation fault", "SIGABRT": "an abort",
                      "SIGKILL": "a SIGKILL (an OOM killer or a person)"}  # fmt: skip


def nvrx_stop(sig: Signature) -> str:
    """Why NVRx 0.7's attribution would answer `sig` with STOP (its RECOMMENDATION_STOP);
    "" where it restarts. Its answers by fault type (`_RESTART_TABLE` of NVRx's
    skills/nvrx-attr/scripts/score_attribution.py): STOP for an application exception, a GPU
    error, a segmentation fault, an OS abort and a SIGKILL; RESTART for a hang, SIGTERM, SIGINT
    and SIGSTOP. The consequences of a failure elsewhere restart (the cause is named there)."""
    if sig.secondary:
        return ""
    if sig.kind == Kind.EXCEPTION and sig.detail not in ("KeyboardInterrupt", "SystemExit"):
        return "an exception in the application, likely a bug"
    if sig.kind == Kind.CUDA:
        return "a GPU error"
    if sig.kind == Kind.SIGNAL:
        return _NVRX_STOP_SIGNALS.get(sig.detail, "")
    if sig.kind == Kind.EXIT and not sig.detail.startswith("exit code"):
        return f"a fatal error ({sig.detail})"  # faulthandler's: a segmentation fault, an abort
    return ""


def signal_name(number: int) -> str:
    """'SIGKILL', or 'signal 99' for a number that names none."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return _clip(lines[-1].strip()) if lines else ""


def _clip(text: str) -> str:
    text = text.splitlines()[0] if text else ""
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 1] + "…"
