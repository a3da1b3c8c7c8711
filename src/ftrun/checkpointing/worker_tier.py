"""The worker's side of the node tier (`tier_files`): where parts go under ft_launcher, what the
agent is asked to do with them, and what it decided to restore."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ftrun.checkpointing.errors import CheckpointUsageError
from ftrun.checkpointing.tier_files import (
    POLICY_FILE,
    PROTECTED_FILE,
    RESTORE_FILE,
    STALL_FILE,
    RestoreDecision,
    TierPolicy,
    read_json,
    session_dir,
    write_json_atomically,
)
from ftrun.environment import Env

logger = logging.getLogger("ftrun.checkpointing")


def agent_tier(session_id: str, repl_strategy: Any) -> Path | None:
    """Under ft_launcher, this session's directory in node memory, with the policy written for
    the agent; None under plain torchrun (no agent keeps parts)."""
    ckpt_dir = os.environ.get(Env.CKPT_DIR)
    if not ckpt_dir:
        return None
    tier = session_dir(ckpt_dir, session_id)
    if repl_strategy is not None and getattr(repl_strategy, "replication_factor", None) is None:
        raise CheckpointUsageError(
            f"repl_strategy {repl_strategy!r} is not a CliqueReplicationStrategy"
        )
    write_policy(tier, repl_strategy)
    return tier


def write_policy(tier: Path, repl_strategy: Any) -> bool:
    """Tell the agent what to do with this session's parts (`POLICY_FILE`); False when node
    memory cannot hold the file (full): said in the log, the caller tries again after a part
    was written. Never fails the training: until then, its parts are not replicated."""
    policy = TierPolicy(
        replication_jump=getattr(repl_strategy, "replication_jump", None),
        replication_factor=getattr(repl_strategy, "replication_factor", None),
    )
    try:
        write_json_atomically(tier / POLICY_FILE, policy.to_json())
        return True
    except OSError as e:
        logger.warning("cannot tell the agent how to keep the parts (%s): not replicated yet", e)
        return False


def note_stall(tier: Path, rank: int, iteration: int, seconds: float) -> None:
    """Tell the agent how long this rank's save of `iteration` blocked training (`STALL_FILE`);
    never fails the save (the figure is for the live view only)."""
    try:
        path = tier / STALL_FILE.format(rank=rank)
        write_json_atomically(path, {"iteration": iteration, "seconds": round(seconds, 6)})
    except OSError as e:
        logger.debug("could not note the save's stall: %s", e)


def restore_decision(tier: Path) -> RestoreDecision | None:
    """What the agents agreed to restore before this cycle's workers started; None when no
    agent wrote a decision (then the manager agrees through a collective, as under torchrun)."""
    return _read_decision(tier, RESTORE_FILE, "restore decision")


def protected_part(tier: Path) -> RestoreDecision | None:
    """The iteration (and world size) the agent asks this node to keep (`PROTECTED_FILE`);
    None when it names none, or names one unreadably (then the usual clean-up applies)."""
    return _read_decision(tier, PROTECTED_FILE, "protected iteration")


def _read_decision(tier: Path, name: str, what: str) -> RestoreDecision | None:
    try:
        raw = read_json(tier / name)
        return None if raw is None else RestoreDecision.from_json(raw, name)
    except (OSError, ValueError) as e:
        logger.warning("ignoring the agent's %s: %s", what, e)
        return None
