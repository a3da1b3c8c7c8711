"""Carrying out the ladder's in-process rungs (the policy decides them, `ladder` says why)."""

from __future__ import annotations

import logging

from ftrun.agent.inprocess.link import Coordination
from ftrun.agent.policy import Action
from ftrun.agent.runtime import AgentRuntime
from ftrun.agent.worker_env import worker_envs
from ftrun.agent.workers import WorkerGroup
from ftrun.errors import FtrunError
from ftrun.rendezvous.ranks import Round

log = logging.getLogger("ftrun.agent")


def carry_out(
    action: Action, rnd: Round | None, group: WorkerGroup | None, rt: AgentRuntime
) -> bool:
    """Interrupt the wrapped ranks (`action.interrupt`), or interrupt them and start the lost
    rank's process again (`action.replace`); False if that could not be done (next rung)."""
    if rnd is None or group is None:
        return False
    link = Coordination(rt.job_dir)
    if (interrupt := action.interrupt) is not None:
        return link.interrupt(rnd.number, interrupt.ranks, "UNRESPONSIVE", interrupt.cause)
    lost = action.replace
    assert lost is not None
    if not link.interrupt(rnd.number, (lost.rank,), "TERMINATED", lost.cause):
        return False
    local_rank = lost.rank - rnd.first_global_rank
    cycle_dir = rt.node_log_dir / f"cycle{rnd.number}"
    env = worker_envs(rt.config, rt.environ, rt.services.worker_env(rnd), rnd, rt.node,
                      cycle_dir)[local_rank]  # fmt: skip
    try:
        pid = group.replace(local_rank, env, rt.spawner, rt.monitor.expect_rank)
    except (OSError, FtrunError) as exc:
        log.error("in-process: rank %d's process cannot start again: %s", lost.rank, exc)
        return False
    log.warning("in-process: %s: its process started again (pid %d)", lost.cause, pid)
    rt.events.emit("rank_replaced", rank=lost.rank, pid=pid, cause=lost.cause)
    return True
