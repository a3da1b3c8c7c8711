"""Build the launcher's one frozen `LaunchConfig` from argv, the environment and the YAML file.

`build_config` is a pure function of its arguments (plus reading the `--ft-cfg-path` file,
for `--nproc-per-node=auto|gpu|xpu` counting devices, and for `--numa-binding` reading the GPUs'
affinity from NVML): it starts nothing and logs nothing; what deserves a warning goes into
`LaunchConfig.warnings` for `main` to log.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ftrun.agent.placement.numa import NumaError, NumaPlan, plan_launch
from ftrun.config.agent import AgentConfig, HealthCheckConfig
from ftrun.config.launch import LaunchConfig
from ftrun.config.monitor import RankMonitorConfig
from ftrun.config.observe import ObserveConfig
from ftrun.config.straggler import StragglerAction, StragglerConfig
from ftrun.errors import ConfigError
from ftrun.ft_launcher.build_rendezvous import rendezvous_config
from ftrun.ft_launcher.command_line import CommandLine, Resolved, parse_argv, resolve
from ftrun.ft_launcher.options import OPTIONS
from ftrun.ft_launcher.yaml_file import load_ft_yaml

DeviceCounter = Callable[[str], int]
"""Counts the local devices for `--nproc-per-node` auto/cpu/gpu/xpu; `ValueError` if none."""


def count_devices(kind: str) -> int:
    """torchrun's `determine_local_world_size` for a device word (imports torch lazily)."""
    if kind == "cpu":
        return _cpu_count()
    import torch

    if kind in ("gpu", "xpu"):
        device, name = (torch.cuda, "CUDA") if kind == "gpu" else (torch.xpu, "XPU")
        if not device.is_available():
            raise ValueError(f"{name} is not available")
        return device.device_count()
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and accelerator.is_available():
        return accelerator.device_count()
    return _cpu_count()


def _cpu_count() -> int:
    """CPUs this process may use (the affinity mask, like torch's `cpu_count`)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def build_config(
    argv: Sequence[str], environ: Mapping[str, str], *, devices: DeviceCounter = count_devices
) -> LaunchConfig:
    """The launch configuration for `ft_launcher ARGV` in `environ`; `ConfigError` if invalid."""
    return config_from(parse_argv(argv), environ, devices=devices)


def config_from(
    line: CommandLine, environ: Mapping[str, str], *, devices: DeviceCounter = count_devices
) -> LaunchConfig:
    """`build_config` for an already parsed command line."""
    if not line.script:
        raise ConfigError("missing SCRIPT (usage: ft_launcher [OPTIONS] SCRIPT [SCRIPT_ARGS]...)")
    path = line.given.get("cfg_path")
    opts = resolve(line, environ, load_ft_yaml(path) if path else {}, origin=path or "YAML")
    notes = _unsupported(opts)
    return LaunchConfig(
        agent=_agent(opts, line, environ, devices, notes),
        rendezvous=rendezvous_config(opts, notes),
        monitor=RankMonitorConfig(
            **_same(opts, "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
                    "rank_section_timeouts", "rank_out_of_section_timeout", "safety_factor",
                    "num_warmup_iterations"),
            calculated_timeout_floor=opts["workload_check_interval"],
        ),
        health=_health(opts, environ, notes),
        log_level=opts["log_level"],
        warnings=tuple(notes),
        straggler=StragglerConfig(
            enabled=opts["straggler_detection"],
            action=StragglerAction(opts["straggler_action"]),
            **{field: opts[f"straggler_{field}"] for field in (
                "report_interval", "gpu_relative_threshold", "gpu_individual_threshold",
                "section_relative_threshold", "section_individual_threshold")},
        ),
        observe=ObserveConfig(**_same(opts, "metrics_port", "status_port"),
                              bind=opts["status_bind"]),
    )  # fmt: skip


def _unsupported(opts: Resolved) -> list[str]:
    """Refuse the options that ftrun does not support; a warning for each ignored one set."""
    notes = []
    for opt in OPTIONS:
        if not opts.is_set(opt.name):
            continue
        if opt.rejected and str(opts.values[opt.name]).strip().lower() in opt.harmless:
            continue  # NVRx's default: asks for nothing ftrun lacks
        if opt.same_as and opts.values[opt.name] == opts.values[opt.same_as]:
            continue  # asks for what ftrun's own option already gives
        if opt.rejected:
            raise ConfigError(f"{opts.labels[opt.name]}: not supported: {opt.rejected}")
        if opt.ignored:
            notes.append(
                f"{opts.labels[opt.name]} is accepted for torchrun compatibility and ignored: "
                f"{opt.ignored}"
            )
    return notes


def _health(opts: Resolved, environ: Mapping[str, str], notes: list[str]) -> HealthCheckConfig:
    if opts["gpu_health_check_nvlink"] and not opts["gpu_health_check"]:
        notes.append(
            f"{opts.labels['gpu_health_check_nvlink']} is ignored: the GPU health check is off"
        )
    if not opts["nic_sysfs_root"]:
        raise ConfigError(f"{opts.labels['nic_sysfs_root']}: must not be empty")
    if opts.is_set("nic_sysfs_root") and not opts["enable_nic_healthcheck"]:
        notes.append(f"{opts.labels['nic_sysfs_root']} is ignored: the NIC health check is off")
    return HealthCheckConfig(
        gpu=opts["gpu_health_check"], nvlink=opts["gpu_health_check_nvlink"],
        storage_paths=opts["storage_health_check_path"], command=opts["node_health_check_cmd"],
        nic=opts["enable_nic_healthcheck"], nic_sysfs_root=opts["nic_sysfs_root"],
        watch_interval=opts["health_interval"], gpus=environ.get("CUDA_VISIBLE_DEVICES"),
    )  # fmt: skip


# --- agent ------------------------------------------------------------------------------------


def _agent(
    opts: Resolved,
    line: CommandLine,
    environ: Mapping[str, str],
    devices: DeviceCounter,
    notes: list[str],
) -> AgentConfig:
    nproc = _local_world_size(opts, devices)
    if opts["virtual_local_rank"]:
        _check_visible_devices(nproc, environ)
    if opts.is_set("gpu_memory_tolerance_mb") and not opts["gpu_memory_reclaim_timeout"]:
        notes.append(
            f"{opts.labels['gpu_memory_tolerance_mb']} is ignored: "
            "--ft-gpu-memory-reclaim-timeout is 0 (off)"
        )
    extra_env: dict[str, str] = {}
    if nproc > 1 and "OMP_NUM_THREADS" not in environ:
        extra_env["OMP_NUM_THREADS"] = "1"  # torchrun's default, to avoid oversubscription
        notes.append("OMP_NUM_THREADS=1 for every worker (torchrun's default); tune it if needed")
    return AgentConfig(
        entrypoint=_entrypoint(opts, line, environ),
        nproc_per_node=nproc,
        log_dir=Path(opts["log_dir"]) if opts["log_dir"] else None,
        redirects=_per_rank(opts["redirects"], nproc),
        tee=_per_rank(opts["tee"], nproc),
        workers_stop_timeout=_stop_timeout(opts),
        termination_signal=_termination_signal(opts, notes),
        prestart_workers=_prestart_workers(opts["prestart_workers"], environ),
        extra_env=MappingProxyType(extra_env),
        numa_binding=_numa_plan(opts, nproc, environ),
        **_same(opts, "role", "max_restarts", "max_no_progress_cycles", "max_same_failure",
                "attribution_stop_action", "no_restart_exit_code", "inprocess_max_restarts",
                "inprocess_restart_window", "inprocess_abort_timeout", "health_action",
                "monitor_interval", "local_ranks_filter", "signals_to_handle",
                "gpu_memory_reclaim_timeout", "gpu_memory_tolerance_mb", "prewarm_modules",
                "prewarm_deep_modules", "duplicate_stdout_filters", "duplicate_stderr_filters",
                "virtual_local_rank"),
    )  # fmt: skip


def _same(opts: Resolved, *names: str) -> dict[str, Any]:
    """The values of the options `names`, by name: for the config fields named as they are."""
    return {name: opts[name] for name in names}


def _termination_signal(opts: Resolved, notes: list[str]) -> signal.Signals:
    """--ft-rank-termination-signal; SIGKILL (NVRx's default, in every YAML NVRx writes) is
    honoured with a warning: NVRx sends it only to the rank it judged failed."""
    value = opts["rank_termination_signal"]
    if value is signal.SIGKILL and opts.is_set("rank_termination_signal"):
        notes.append(
            f"{opts.labels['rank_termination_signal']}=SIGKILL: ftrun stops workers with it "
            "(a forwarded preemption signal aside), leaving them no time to save; NVRx sends it "
            "only to the rank it judged failed (ftrun kills a hung rank with SIGKILL anyway) and "
            "SIGTERM to the others, as ftrun's default SIGTERM does"
        )
    return value


def _prestart_workers(mode: str, environ: Mapping[str, str]) -> bool:
    """--ft-prestart-workers, decided once here: auto is on where NVML sees a visible GPU."""
    if mode != "auto":
        return mode == "on"
    from ftrun.nvml import nvml_session, visible_gpus

    with nvml_session() as nvml:
        if nvml is None:
            return False
        try:
            return bool(visible_gpus(nvml, environ.get("CUDA_VISIBLE_DEVICES")))
        except Exception:  # an entry NVML cannot name: the workers will say what is wrong
            return False


def _numa_plan(opts: Resolved, nproc: int, environ: Mapping[str, str]) -> NumaPlan | None:
    """--numa-binding's binding of every local rank, decided once here (it reads NVML): a node
    where it cannot be honoured is a usage error at start, not a surprise in every worker."""
    mode = opts["numa_binding"]
    if mode is None:
        return None
    try:
        return plan_launch(mode, nproc, environ.get("CUDA_VISIBLE_DEVICES"))
    except NumaError as err:
        raise ConfigError(f"{opts.labels['numa_binding']}={mode}: {err}") from None


def _check_visible_devices(nproc: int, environ: Mapping[str, str]) -> None:
    """--virtual-local-rank gives local rank N entry N of CUDA_VISIBLE_DEVICES: it needs one
    per worker (torchrun finds out when it starts the workers; this says so before)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return
    count = len(visible.split(","))  # split as torch splits it
    if nproc > count:
        raise ConfigError(
            f"--virtual-local-rank gives each of the {nproc} workers one GPU of "
            f"CUDA_VISIBLE_DEVICES={visible}, which names {count}"
        )


def _local_world_size(opts: Resolved, devices: DeviceCounter) -> int:
    value = opts["nproc_per_node"]
    if isinstance(value, int):
        return value
    try:
        count = devices(value)
    except ValueError as err:
        raise ConfigError(f"{opts.labels['nproc_per_node']}={value}: {err}") from None
    if count < 1:
        raise ConfigError(f"{opts.labels['nproc_per_node']}={value}: no such devices found")
    return count


def _entrypoint(opts: Resolved, line: CommandLine, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The worker command, built like torchrun builds it (PYTHON_EXEC overrides the python)."""
    script, args = str(line.script), line.script_args
    python = environ.get("PYTHON_EXEC") or sys.executable
    if opts["module"] and (opts["no_python"] or opts["run_path"]):
        other = "--no-python" if opts["no_python"] else "--run-path"
        raise ConfigError(f"{other} and --module cannot be used together")
    if opts["no_python"] and not opts["run_path"]:  # --run-path beats --no-python
        return (script, *args)
    if opts["module"]:
        return (python, "-u", "-m", script, *args)
    return (python, "-u", script, *args)


def _per_rank(spec: int | Mapping[int, int], nproc: int) -> Mapping[int, int]:
    """torchrun's redirect/tee value as local rank -> Std flags (ranks with none are left out)."""
    pairs = spec.items() if isinstance(spec, Mapping) else ((rank, spec) for rank in range(nproc))
    return MappingProxyType({rank: flags for rank, flags in pairs if flags})


def _stop_timeout(opts: Resolved) -> float:
    """--workers-stop-timeout, or torchrun's --shutdown-timeout for the same thing."""
    ours, theirs = opts["workers_stop_timeout"], opts["shutdown_timeout"]
    if not opts.is_set("shutdown_timeout"):
        return ours
    if opts.is_set("workers_stop_timeout") and float(theirs) != ours:
        raise ConfigError(
            f"{opts.labels['shutdown_timeout']}={theirs} and "
            f"{opts.labels['workers_stop_timeout']}={ours} disagree; give one"
        )
    return float(theirs)
