"""What the agent writes down about a cycle: worker exits, hangs (with stack files), GPU memory
reclaim. Events for tools, one clear log line for people."""

from __future__ import annotations

import logging
import signal

from ftrun.agent.gpu_memory import wait_until_released
from ftrun.agent.runtime import AgentRuntime
from ftrun.agent.workers import WorkerExited
from ftrun.rank_monitor import Verdict
from ftrun.rank_monitor.stacks import where_stuck
from ftrun.rendezvous.ranks import Round

log = logging.getLogger("ftrun.agent")


class CycleReport:
    """Records one node's cycle outcomes into its events file and log."""

    def __init__(self, runtime: AgentRuntime) -> None:
        self.rt = runtime
        self.events = runtime.events

    def worker_exit(self, item: WorkerExited) -> None:
        fields: dict[str, object] = {
            "rank": item.rank,
            "local_rank": item.local_rank,
            "pid": item.pid,
            "code": item.returncode,
        }
        if item.returncode < 0:
            fields["signal"] = signal.Signals(-item.returncode).name
        self.events.emit("worker_exited", **fields)

    def hang(self, verdict: Verdict, rnd: Round | None) -> None:
        """Keep the stacks with the cycle's logs and say in one line who hung where."""
        cycle = rnd.number if rnd else self.events.cycle
        dump = self.rt.node_log_dir / f"cycle{cycle}" / f"stack-rank{verdict.rank}.txt"
        dump.parent.mkdir(parents=True, exist_ok=True)
        dump.write_text(verdict.stack or "(the rank did not dump its stacks)\n")
        where = f"in section {verdict.section!r}" if verdict.section else f"({verdict.kind.value})"
        stuck = where_stuck(verdict.stack)
        stuck_text = stuck.describe() if stuck else None
        log.error(
            "HANG: rank %d on node %s %s: no progress for %.3fs (timeout %.3gs), %s; stacks: %s",
            verdict.rank, self.rt.node, where, verdict.waited, verdict.timeout,
            stuck_text or "no stack dump", dump,
        )  # fmt: skip
        self.events.emit(
            "hang",
            rank=verdict.rank,
            pid=verdict.pid,
            kind=verdict.kind.value,
            section=verdict.section,
            timeout=verdict.timeout,
            waited=round(verdict.waited, 6),
            detection_latency=round(verdict.detected_at - verdict.deadline, 6),
            stack_file=str(dump),
            where=stuck_text,
            in_library=stuck.in_library if stuck else None,
        )

    def gpu_memory_reclaim(self, pids: list[int]) -> None:
        """Before a restart, wait (bounded) until the stopped workers' GPU memory is free."""
        cfg = self.rt.config.agent
        baseline = self.rt.gpu_baseline
        if baseline is None or cfg.gpu_memory_reclaim_timeout <= 0:
            return
        reclaim = wait_until_released(
            baseline, pids, cfg.gpu_memory_reclaim_timeout, cfg.gpu_memory_tolerance_mb
        )
        self.events.emit(
            "gpu_memory_reclaimed",
            duration=round(reclaim.duration, 6),
            released=reclaim.released,
            excess_mb=round(reclaim.excess_mb, 1),
        )
        if reclaim.released:
            log.info("GPU memory of the stopped workers released in %.3fs", reclaim.duration)
        else:
            log.warning(
                "GPU memory still %.0f MB above its baseline after %.1fs; starting anyway",
                reclaim.excess_mb, reclaim.duration,
            )  # fmt: skip
