"""What the agent writes down about a cycle: worker exits, hangs (with stack files), and the
training progress the rank monitor saw. Events for tools, one clear log line for people."""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Sequence

from ftrun.agent.decisions.attribution import Signature
from ftrun.agent.loop.runtime import AgentRuntime
from ftrun.agent.prewarm.marks import append, forget_marks, read_marks
from ftrun.agent.workers import WorkerExited
from ftrun.rank_monitor import FirstProgress, ProgressSnapshot, Verdict
from ftrun.rendezvous.ranks import Round

log = logging.getLogger("ftrun.agent")

FAILURES_FILE = "failures.jsonl"
STOP_HINT = "SIGSTOP or a debugger; killed with SIGKILL"


class CycleReport:
    """Records one node's cycle outcomes into its events file and log."""

    def __init__(self, runtime: AgentRuntime) -> None:
        self.rt = runtime
        self.events = runtime.events
        self._awaited: dict[int, int] = {}  # rank -> worker pid, of the current cycle
        self._first: dict[int, FirstProgress] = {}
        self._started = 0.0

    def worker_exit(self, item: WorkerExited) -> None:
        code = item.returncode
        killed = {"signal": signal.Signals(-code).name} if code < 0 else {}
        self.events.emit("worker_exited", rank=item.rank, local_rank=item.local_rank,
                         pid=item.pid, code=code, **killed)  # fmt: skip

    def failure(self, signature: Signature, decision: str, reason: str) -> None:
        """A failure of this node, named, and what the policy made of it: an event, and a line
        of `<log-dir>/failures.jsonl` (one file for the job's nodes; one O_APPEND write each)."""
        fields = signature.as_dict() | {"decision": decision}
        if reason:
            fields["reason"] = reason
        self.events.emit("failure", **fields)
        line = {"ts": round(time.time(), 6), "node": self.rt.node, "cycle": self.events.cycle}
        data = (json.dumps(line | fields) + "\n").encode()
        path = self.rt.node_log_dir.parent / FAILURES_FILE
        try:
            append(path, data, 0o644)
        except OSError as exc:
            log.warning("could not append to %s: %s", path, exc)

    def hang(self, verdict: Verdict, rnd: Round | None) -> None:
        """Keep the stacks with the cycle's logs and say in one line who hung where."""
        cycle = rnd.number if rnd else self.events.cycle
        dump = self.rt.node_log_dir / f"cycle{cycle}" / f"stack-rank{verdict.rank}.txt"
        none = "(the rank did not dump its stacks)\n"
        if verdict.stopped:
            none = f"(the rank's process was stopped: it could not dump its stacks; {STOP_HINT})\n"
        kept: str | None = str(dump)
        try:
            dump.parent.mkdir(parents=True, exist_ok=True)
            dump.write_text(verdict.stack or none)
        except OSError as exc:  # a full log disk must not stop the supervision
            log.warning("the stacks of rank %d are not kept: %s", verdict.rank, exc)
            kept = None
        where = f"in section {verdict.section!r}" if verdict.section else f"({verdict.kind.value})"
        stuck = verdict.stuck
        stuck_text = stuck.describe() if stuck else None
        if verdict.stopped:  # the others wait for it: it is the one to look at
            stuck_text = f"process stopped ({STOP_HINT})"
        log.error(
            "HANG: rank %d on node %s %s: no progress for %.3fs (timeout %.3gs), %s; stacks: %s",
            verdict.rank, self.rt.node, where, verdict.waited, verdict.timeout,
            stuck_text or "no stack dump", kept or "not kept",
        )  # fmt: skip
        self.events.emit(
            "hang", rank=verdict.rank, pid=verdict.pid, kind=verdict.kind.value,
            section=verdict.section, timeout=verdict.timeout, waited=round(verdict.waited, 6),
            detection_latency=round(verdict.detected_at - verdict.deadline, 6),
            stack_file=kept, where=stuck_text,
            in_library=stuck.in_library if stuck else None, stopped=verdict.stopped,
        )  # fmt: skip

    # ---- training progress (from the rank monitor) -------------------------------------------

    def expect_progress(
        self, ranks: Sequence[int], pids: Sequence[int], started: float | None = None
    ) -> None:
        """A cycle's workers started (`ranks[i]` in process `pids[i]`; the spawns began at
        monotonic `started`, default now): await their progress."""
        self._awaited = dict(zip(ranks, pids, strict=True))
        self._first = {}
        self._started = time.monotonic() if started is None else started

    def first_progress(self, item: FirstProgress) -> None:
        """A rank's first progress; once every local rank has shown one, emit `stepping`.

        Notes about workers of another cycle (or already noted ranks) are ignored, so the agent
        may pass on every note it receives."""
        if self._awaited.get(item.rank) != item.worker_pid or item.rank in self._first:
            return
        self._first[item.rank] = item
        self._rank_startup(item.rank, item.worker_pid, item.at)
        if len(self._first) < len(self._awaited):
            return
        ranks = sorted(self._first)
        at = max(p.at for p in self._first.values())
        startup = at - self._started
        self.events.emit(
            "stepping", ranks=ranks, progress_ts=_wall(at), progress_mono=round(at, 6),
            iterations=[self._first[r].iteration for r in ranks], startup=round(startup, 6),
        )  # fmt: skip
        log.info(
            "cycle %d: all %d local rank(s) stepping, %.2fs after their start",
            self.events.cycle, len(ranks), startup,
        )  # fmt: skip

    def _rank_startup(self, rank: int, pid: int, first_step: float | None) -> None:
        """Where this rank's start went: the moments its worker marked (`prewarm.marks`), and
        its first progress (None: it showed none), as seconds from the workers' start."""
        marks = read_marks(self.rt.job_dir, pid)
        forget_marks(self.rt.job_dir, pid)

        def since_start(at: float | None) -> float | None:
            return None if at is None else round(max(0.0, at - self._started), 6)

        self.events.emit(
            "rank_startup", rank=rank, pid=pid, path="forked" if "script" in marks else "spawned",
            to_script=since_start(marks.get("script")), to_cuda=since_start(marks.get("cuda")),
            to_pg=since_start(marks.get("pg")), to_first_step=since_start(first_step),
        )  # fmt: skip

    def last_progress(self, snapshot: Sequence[ProgressSnapshot], before: str = "stop") -> None:
        """Where the local ranks last were, from `RankMonitorServer.progress_snapshot()` taken
        right before the workers are stopped (`before="stop"`) or once they all exited 0
        (`before="finished"`). Ranks that showed no progress (no client) still get their
        start-up split, without the first step."""
        for rank, pid in self._awaited.items():
            if rank not in self._first:
                self._rank_startup(rank, pid, None)
        self._awaited = {}
        ranks = sorted(snapshot, key=lambda s: s.rank)
        times = [s.last_progress for s in ranks if s.last_progress is not None]
        latest = max(times) if times else None
        self.events.emit(
            "last_progress", before=before, ranks=[s.rank for s in ranks],
            progress_ts=None if latest is None else _wall(latest),
            progress_mono=None if latest is None else round(latest, 6),
            iterations=[s.last_iteration for s in ranks],
        )  # fmt: skip


def _wall(mono: float) -> float:
    """The wall-clock time of a moment on this host's monotonic clock."""
    return round(time.time() - (time.monotonic() - mono), 6)
