"""The per-node agent's configuration (built by `ftrun.ft_launcher.build` only)."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from ftrun.inprocess_protocol import RestartBudget


class Std:
    """Bit flags for which worker streams are redirected/teed to files (torchrun's values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclasses.dataclass(frozen=True)
class Binding:
    """Where one worker runs: logical CPUs, and the NUMA nodes its memory comes from (empty:
    memory is left alone)."""

    cpus: frozenset[int]
    mems: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class NumaPlan:
    """The binding of every local rank, decided once per launch (`agent.placement.numa`)."""

    mode: str
    bindings: tuple[Binding, ...]
    """Index = local rank."""


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """How one node runs, watches, stops and restarts its local workers."""

    entrypoint: tuple[str, ...]
    """The full worker command line (python -u script args, python -m mod args, or no-python)."""
    nproc_per_node: int = 1
    role: str = "default"
    max_restarts: int = 0
    max_no_progress_cycles: int = 3
    """Stop the job (exit `ExitCode.NO_PROGRESS`) after this many cycles in a row whose ranks
    reported no iteration past the job's best; <= 0: never. Jobs that report no iterations
    through the client are not judged."""
    max_same_failure: int = 3
    """Stop the job (exit `ExitCode.REPEATED_FAILURE`) once the same failure signature has
    ended this many cycles in a row, on any nodes; <= 0: never (`agent.diagnosis.repeats`)."""
    attribution_stop_action: str | None = None
    """NVRx's: 'no-restart' stops the job (`ExitCode.REPEATED_FAILURE`) at the first failure NVRx's
    attribution answers STOP (`decisions.attribution.nvrx_stop`); 'log' logs that; None: neither."""
    no_restart_exit_code: int | None = None
    """NVRx's: the launcher's exit status for `errors.NO_RESTART` decisions (None: their own)."""
    inprocess_max_restarts: int = 3
    """In-process restarts (`ftrun.inprocess`) a cycle allows within `inprocess_restart_window`,
    whoever started them, before the in-job restart; 0: no limit. With `max_same_failure`, the
    tier's one budget (`inprocess_protocol.RestartBudget`), handed to the wrapped ranks."""
    inprocess_restart_window: float = 120.0
    inprocess_abort_timeout: float = 30.0
    """Seconds a wrapped rank's abort of its process groups may take before it gives up on
    in-process restart (its process ends: the in-job restart)."""
    health_action: str = "exclude"
    """What a fault the health watch finds while training does: 'log', 'restart' or
    'exclude' (the node leaves if a standby node or the minimum size allows; else logged)."""
    monitor_interval: float = 0.1
    log_dir: Path | None = None
    """Where events and per-cycle worker logs go; None means a fresh directory under /tmp."""
    redirects: Mapping[int, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """local rank -> Std flags of streams written to files only (missing rank: Std.NONE)."""
    tee: Mapping[int, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """local rank -> Std flags of streams written to files and the console."""
    local_ranks_filter: frozenset[int] | None = None
    """Local ranks whose output reaches the console; None means all."""
    workers_stop_timeout: float = 15.0
    termination_signal: signal.Signals = signal.SIGTERM
    signals_to_handle: tuple[signal.Signals, ...] = (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    exit_barrier_timeout: float = 300.0
    node_name: str | None = None
    """Names this node in events and logs; None: SLURMD_NODENAME, else host and pid."""
    gpu_memory_reclaim_timeout: float = 0.0
    """After a stop, wait up to this long for the dead workers' GPU memory to be freed (0: off)."""
    gpu_memory_tolerance_mb: float = 512.0
    """GPU memory still in use (per device) that counts as released."""
    prewarm_modules: tuple[str, ...] = ("torch", "torch.distributed")
    """Modules the node's fork server imports once, at launch; workers are forked from it
    (empty: every worker is spawned fresh). The first cycle waits for these alone: what nearly
    every worker imports anyway."""
    prewarm_deep_modules: tuple[str, ...] = ("torch._dynamo",)
    """Imported by the fork server once the first cycle's workers run, for later cycles:
    DistributedDataParallel imports torch._dynamo in every worker, and where triton is installed
    that brings triton and torch._inductor (4.3 s of each restart on the GPU device), while the
    first cycle should not wait for modules that a script may never use. Not
    torch._inductor.compile_fx: its import starts a CUDA driver thread (measured on the device),
    after which the server cannot fork and is replaced without its deep imports."""
    prestart_workers: bool = False
    """Keep one worker per local rank forked, its CUDA context made, for the next start of that
    rank (`prewarm.prestart`); decided once per launch from `--ft-prestart-workers` (auto: where
    NVML sees a GPU)."""
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """Added to every worker's environment (e.g. OMP_NUM_THREADS)."""
    duplicate_stdout_filters: tuple[str, ...] = ()
    """torchrun's --duplicate-stdout-filters: stdout lines on the console containing any of these
    are also appended to the cycle's filtered_stdout.log (`ftrun.agent.output`)."""
    duplicate_stderr_filters: tuple[str, ...] = ()
    """The same for stderr (filtered_stderr.log)."""
    virtual_local_rank: bool = False
    """torchrun's --virtual-local-rank: LOCAL_RANK=0 and one visible GPU per worker
    (`ftrun.agent.placement.rank_env.rank_variables`)."""
    numa_binding: NumaPlan | None = None
    """torchrun's --numa-binding: the mode and each local rank's CPUs and memory nodes, read from
    NVML once when the config is built (`agent.placement.numa`); None: workers are not bound."""

    @property
    def inprocess_budget(self) -> RestartBudget:
        return RestartBudget(self.inprocess_max_restarts, self.inprocess_restart_window,
                             max(self.max_same_failure, 0))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HealthCheckConfig:
    """Checks a node passes before every rendezvous round."""

    gpu: bool = True
    """Check GPUs through NVML when present (skipped, with a log line, when there are none)."""
    nvlink: bool = False
    """Also require every NVLink the GPUs report to be up; while training, also watch their
    error counters (`node_services.nvlink_window`)."""
    storage_paths: tuple[str, ...] = ()
    storage_timeout: float = 10.0
    command: str | None = None
    """An external command; exit 0 means healthy."""
    command_timeout: float = 60.0
    nic: bool = False
    """Check every InfiniBand port in sysfs (`ftrun.infiniband`): ACTIVE, LinkUp, not
    flapped."""
    nic_sysfs_root: str = "/sys/class/infiniband"
    """Where the NIC check finds the devices (tests point it at a fake tree)."""
    gpus: str | None = None
    """The GPUs this launcher's workers use, as its CUDA_VISIBLE_DEVICES names them: the only
    ones checked and watched (None, unset: every GPU NVML sees). Two launchers on one host
    then each answer for their own GPUs."""
    watch_interval: float = 5.0
    """While workers run, read GPU health (and, with `nic`, the link_downed counters) every
    this many seconds (`node_services.health_watch`); 0: only before each rendezvous."""
