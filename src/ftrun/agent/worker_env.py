"""Every worker's environment, built in this one place: torchrun's variables, the services'
(monitor address, ...), the launcher's additions, and each rank's own."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ftrun.agent.placement.numa import binding_env
from ftrun.agent.placement.rank_env import rank_variables
from ftrun.client_lib.flight import BUFFER_VARS
from ftrun.config.launch import LaunchConfig
from ftrun.environment import Env
from ftrun.rendezvous.ranks import Round

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""torch's switch: the workers' store is served already (`node_services.worker_store`)."""

PER_CYCLE = frozenset({
    "RANK", "ROLE_RANK", "GROUP_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", Env.CYCLE,
    "TORCHELASTIC_ERROR_FILE", Env.INPROCESS_PREFIX, AGENT_STORE_ENV,
})  # fmt: skip
"""The variables that may change from one cycle's worker of a local rank to the next's; a
prestarted worker, made with the cycle's before, runs only where nothing else differs
(`prewarm.prestart`). No process reads them before the script does."""

FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives each worker's flight recorder keeps (torch's own suggestion for NCCL jobs)."""


def worker_envs(
    config: LaunchConfig,
    environ: Mapping[str, str],
    services_env: Mapping[str, str],
    rnd: Round,
    node: str,
    cycle_dir: Path,
) -> list[dict[str, str]]:
    """One environment per local rank of this node in round `rnd` (index = local rank)."""
    shared = shared_env(config, environ, services_env, rnd, node)
    for name in (Env.CPU_BIND, Env.MEM_BIND):  # a launcher started by a worker: not their binding
        shared.pop(name, None)
    numa = config.agent.numa_binding  # decided once per launch, from NVML
    first, visible = rnd.first_global_rank, environ.get("CUDA_VISIBLE_DEVICES")
    return [
        {
            **shared,
            **rank_variables(
                local_rank, first + local_rank, config.agent.virtual_local_rank, visible
            ),
            **(binding_env(numa, local_rank) if numa is not None else {}),
            "TORCHELASTIC_ERROR_FILE": str(cycle_dir / f"rank{first + local_rank}" / "error.json"),
        }
        for local_rank in range(rnd.me.local_world_size)
    ]


def shared_env(
    config: LaunchConfig,
    environ: Mapping[str, str],
    services_env: Mapping[str, str],
    rnd: Round | None,
    node: str,
) -> dict[str, str]:
    """What every local worker of the round shares, as torchrun sets it (without a round: the
    part known before any rendezvous, for processes started ahead of the workers)."""
    agent, rdzv = config.agent, config.rendezvous
    env = {**environ, **agent.extra_env, **services_env}
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # Attribution: torch's flight recorder (a hang names the collective a rank never entered),
    # unless the user sized it (0: off), and faulthandler's stacks on a fatal signal.
    if not any(name in env for name in BUFFER_VARS):
        env[BUFFER_VARS[0]] = str(FLIGHT_RECORDER_ENTRIES)
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.update(
        ROLE_NAME=agent.role,
        TORCHELASTIC_MAX_RESTARTS=str(agent.max_restarts),
        TORCHELASTIC_RUN_ID=rdzv.run_id,
        # True where this node's agent hosts the workers' store (`worker_store`).
        TORCHELASTIC_USE_AGENT_STORE=services_env.get(AGENT_STORE_ENV, "False"),
    )
    env[Env.NODE] = node
    if rnd is not None:
        env.update(
            LOCAL_WORLD_SIZE=str(rnd.me.local_world_size),
            WORLD_SIZE=str(rnd.world_size),
            GROUP_RANK=str(rnd.group_rank),
            GROUP_WORLD_SIZE=str(len(rnd.nodes)),
            ROLE_WORLD_SIZE=str(rnd.world_size),
            MASTER_ADDR=rnd.master.host,
            MASTER_PORT=str(rnd.master.master_port),
            TORCHELASTIC_RESTART_COUNT=str(rnd.number),
        )
        env[Env.CYCLE] = str(rnd.number)
    return env
