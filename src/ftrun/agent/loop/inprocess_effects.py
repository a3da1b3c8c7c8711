"""Carrying out the ladder's in-process rungs (the policy decides them, `ladder` says why)."""

from __future__ import annotations

import logging

from ftrun.agent.decisions.policy import Action
from ftrun.agent.loop.runtime import AgentRuntime
from ftrun.agent.worker_env import worker_envs
from ftrun.agent.workers import WorkerGroup
from ftrun.errors import FtrunError
from ftrun.rendezvous.ranks import Round

log = logging.getLogger("ftrun.agent")


def carry_out(action: Action, rnd: Round, group: WorkerGroup, rt: AgentRuntime) -> str | None:
    """Interrupt the wrapped ranks (`action.interrupt`), or interrupt them and start the lost
    rank's process again (`action.replace`); None once done, else why it could not be (the
    policy then decides on the next rung)."""
    if (interrupt := action.interrupt) is not None:
        if rt.inprocess.interrupt(interrupt.ranks, "UNRESPONSIVE", interrupt.cause):
            return None
        return "the wrapped ranks' store cannot be reached"
    lost = action.replace
    assert lost is not None
    if not rt.inprocess.interrupt((lost.rank,), "TERMINATED", lost.cause):
        return "the wrapped ranks' store cannot be reached"
    local_rank = lost.rank - rnd.first_global_rank
    cycle_dir = rt.node_log_dir / f"cycle{rnd.number}"
    env = worker_envs(rt.config, rt.environ, rt.services.worker_env(rnd), rnd, rt.node,
                      cycle_dir)[local_rank]  # fmt: skip
    try:
        pid = group.replace(local_rank, env, rt.spawner, rt.monitor.expect_rank)
    except (OSError, FtrunError) as exc:
        log.error("in-process: rank %d's process cannot start again: %s", lost.rank, exc)
        return f"rank {lost.rank}'s process cannot start again"
    log.warning("in-process: %s: its process started again (pid %d)", lost.cause, pid)
    rt.events.emit("rank_replaced", rank=lost.rank, pid=pid, cause=lost.cause)
    return None
