"""ft_launcher's options, config building and error path, all in this process."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
import signal
import sys
import types
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ftrun.agent.placement.numa import NumaPlan
from ftrun.config.agent import AgentConfig, HealthCheckConfig
from ftrun.config.launch import LaunchConfig
from ftrun.config.monitor import RankMonitorConfig
from ftrun.config.rendezvous import RendezvousConfig, RendezvousImpl
from ftrun.errors import ConfigError, ExitCode, FtrunError
from ftrun.ft_launcher import build as build_module
from ftrun.ft_launcher import cli
from ftrun.ft_launcher.build import build_config
from ftrun.ft_launcher.command_line import help_text, parse_argv
from ftrun.ft_launcher.nvrx_options import NVRX_OPTIONS
from ftrun.ft_launcher.options import BY_NAME, OPTIONS, YAML_KEYS

PY = sys.executable
NVRX_YAML_KEYS = {
    "initial_rank_heartbeat_timeout",
    "rank_heartbeat_timeout",
    "rank_section_timeouts",
    "rank_out_of_section_timeout",
    "safety_factor",
    "workload_check_interval",
    "num_warmup_iterations",
    "rank_termination_signal",
    "workers_stop_timeout",
    "rdzv_impl",
    "use_infra_group_rank",
    "max_no_progress_cycles",
    "attribution_stop_action",
    "log_level",
    "node_health_check_cmd",
    "storage_health_check_path",
    "prewarm_modules",
    "prewarm_deep_modules",
    "prestart_workers",
    "gpu_health_check",
    "gpu_health_check_nvlink",
    "enable_nic_healthcheck",
    "nic_sysfs_root",
    "gpu_memory_reclaim_timeout",
    "gpu_memory_tolerance_mb",
    # ftrun's own (NVRx configures its straggler detection in the training script)
    "straggler_detection",
    "straggler_report_interval",
    "straggler_gpu_relative_threshold",
    "straggler_gpu_individual_threshold",
    "straggler_section_relative_threshold",
    "straggler_section_individual_threshold",
    "straggler_action",
    "max_same_failure",
    "inprocess_max_restarts",
    "inprocess_restart_window",
    "inprocess_abort_timeout",
    "health_interval",
    "health_action",
    "metrics_port",
    "status_port",
    "status_bind",
    "store_reconnect_timeout",
}


def build(*argv: str, env: Mapping[str, str] | None = None, **kw: Any) -> LaunchConfig:
    return build_config(argv, env or {}, **kw)


def config_error(*argv: str, env: Mapping[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        build(*argv, env=env)
    message = str(info.value)
    assert "\n" not in message
    return message


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ft.yaml"
    path.write_text(text)
    return str(path)


# --- torchrun compatibility ------------------------------------------------------------------


@pytest.fixture
def torchrun_actions(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import os

    import torch.distributed.run as torchrun

    for name in [key for key in os.environ if key.startswith("PET_")]:
        monkeypatch.delenv(name)
    parser = torchrun.get_args_parser()
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_torchrun_option_with_its_flags_env_and_default(torchrun_actions: list[Any]) -> None:
    for action in torchrun_actions:
        ours = BY_NAME[action.dest]
        assert set(ours.flags) == set(action.option_strings), action.dest
        reads_env = type(action).__name__ in ("env", "check_env")
        assert ours.env == (f"PET_{action.dest.upper()}" if reads_env else None), action.dest
        if action.default is None:
            assert ours.default is None, action.dest
        else:
            assert ours.parse(ours.default) == ours.parse(action.default), action.dest
        if action.choices:
            assert tuple(ours.parse.choices) == tuple(action.choices), action.dest  # type: ignore[attr-defined]


def test_defaults() -> None:
    config = build("train.py")
    assert config.agent == AgentConfig(entrypoint=(PY, "-u", "train.py"))
    assert config.monitor == RankMonitorConfig()
    assert config.health == HealthCheckConfig()
    assert config.log_level == "INFO"
    assert config.warnings == ()
    rdzv = config.rendezvous
    # torchrun: one static node without --master-port gets a local store on a free port.
    assert (rdzv.backend, rdzv.endpoint, rdzv.is_host) == ("c10d", "127.0.0.1:0", True)
    assert (rdzv.min_nodes, rdzv.max_nodes, rdzv.impl) == (1, 1, RendezvousImpl.BARRIER)
    uuid.UUID(rdzv.run_id)
    agent = config.agent
    assert (agent.nproc_per_node, agent.max_restarts, agent.monitor_interval) == (1, 0, 0.1)
    assert agent.signals_to_handle == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    assert agent.workers_stop_timeout == 15.0


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda opt: opt.name)
def test_every_spelling_sets_its_option(opt: Any) -> None:
    for flag in (*opt.flags, *opt.off_flags):
        # An option with a flag_value (NVRx's bare flags) takes its value only after `=`.
        argv = [flag] if opt.is_flag or opt.flag_value else [flag, "1"]
        line = parse_argv([*argv, "train.py"])
        assert opt.name in line.given, flag
        assert line.script == "train.py"
    assert all(flag in help_text() for flag in opt.flags)


def test_both_spellings_give_the_same_config() -> None:
    dashed = build("--nproc-per-node=2", "--max-restarts=3", "--ft-rank-heartbeat-timeout=9", "x")
    underscored = build(
        "--nproc_per_node", "2", "--max_restarts=3", "--ft_rank_heartbeat_timeout=9", "x"
    )
    assert dashed.agent == underscored.agent
    assert dashed.monitor == underscored.monitor
    assert build("--ft_no_gpu_health_check", "x").health.gpu is False
    assert build("--workers_stop_timeout=2.5", "x").agent.workers_stop_timeout == 2.5


def test_nnodes_min_max() -> None:
    rdzv = build("--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "x").rendezvous
    assert (rdzv.min_nodes, rdzv.max_nodes) == (2, 4)
    rdzv = build("--nnodes", "3", "--master-addr=h", "x").rendezvous
    assert (rdzv.min_nodes, rdzv.max_nodes) == (3, 3)
    for bad in ("0", "3:2", "a", "1:2:3", "0:2", ""):
        assert "--nnodes" in config_error(f"--nnodes={bad}", "x")


# --- rendezvous ------------------------------------------------------------------------------


def test_static_rendezvous_uses_master_addr_port_and_node_rank() -> None:
    rdzv = build("--nnodes=2", "--node-rank=1", "--master-addr=node0", "x").rendezvous
    assert (rdzv.backend, rdzv.endpoint, rdzv.node_rank, rdzv.run_id) == (
        "static",
        "node0:29500",
        1,
        "none",
    )
    assert build("--nnodes=2", "--master_port=1234", "x").rendezvous.endpoint == "127.0.0.1:1234"
    assert build("--master-port=7", "x").rendezvous.endpoint == "127.0.0.1:7"  # no local store
    rdzv = build("--nnodes=2", "--rdzv-endpoint=[::1]:77", "--master-addr=ignored", "x").rendezvous
    assert rdzv.endpoint == "[::1]:77"
    assert "--node-rank" in config_error("--nnodes=2", "--node-rank=2", "x")
    assert "no port" in config_error("--nnodes=2", "--rdzv-endpoint=node0", "x")


def test_c10d_rendezvous_and_rdzv_conf() -> None:
    config = build(
        "--nnodes=1:2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0",
        "--rdzv-id=job7",
        "--rdzv-conf=join_timeout=60,last_call_timeout=5,is_host=false,read_timeout=9",
        "--node-rank=1",
        "x",
    )
    rdzv = config.rendezvous
    assert (rdzv.endpoint, rdzv.run_id, rdzv.node_rank) == ("node0:29400", "job7", None)
    assert (rdzv.join_timeout, rdzv.last_call_timeout, rdzv.close_timeout) == (60.0, 5.0, 30.0)
    assert rdzv.is_host is False
    assert dict(rdzv.conf) == {"read_timeout": "9.0"}
    assert config.warnings == ("--node-rank ignored: only used with --rdzv-backend=static",)
    assert build("--rdzv-backend=c10d", "x").rendezvous.endpoint == "localhost:29400"
    assert "join_timeout" in config_error("--rdzv-conf=join_timeout=-1", "x")
    assert "--rdzv-conf" in config_error("--rdzv-conf=novalue", "x")
    assert "65535" in config_error("--rdzv-backend=c10d", "--rdzv-endpoint=h:70000", "x")
    assert "--rdzv-backend" in config_error("--rdzv-backend=etcd-v2", "x")


def test_standalone_ignores_rendezvous_flags() -> None:
    config = build(
        "--standalone", "--rdzv-endpoint=far:1", "--rdzv-id=mine", "--nproc-per-node=2", "x"
    )
    rdzv = config.rendezvous
    assert "--rdzv-endpoint, --rdzv-id ignored: --standalone uses a local store" in config.warnings
    assert (rdzv.backend, rdzv.endpoint, rdzv.is_host) == ("c10d", "127.0.0.1:0", True)
    assert (rdzv.min_nodes, rdzv.max_nodes) == (1, 1)
    assert rdzv.run_id != build("--standalone", "x").rendezvous.run_id
    uuid.UUID(rdzv.run_id)
    assert "--standalone" in config_error("--standalone", "--nnodes=2", "x")


def test_rdzv_impl_and_its_legacy_alias() -> None:
    assert build("x").rendezvous.impl is RendezvousImpl.BARRIER
    assert build("--ft-rdzv-impl=legacy", "x").rendezvous.impl is RendezvousImpl.DYNAMIC
    assert build("--ft_rdzv_impl", "dynamic", "x").rendezvous.impl is RendezvousImpl.DYNAMIC
    assert "barrier, dynamic" in config_error("--ft-rdzv-impl=v3", "x")
    assert build("--ft-use-infra-group-rank", "x").rendezvous.use_infra_group_rank is True


# --- entrypoint and workers ------------------------------------------------------------------


def test_script_arguments_pass_through_untouched() -> None:
    args = ("--nnodes=5", "-m", "--", "--help", "--ft-rank-heartbeat-timeout=abc", "-r", "9")
    config = build("--nproc-per-node=2", "train.py", *args)
    assert config.agent.entrypoint == (PY, "-u", "train.py", *args)
    assert config.agent.nproc_per_node == 2
    assert build("--", "train.py", "a").agent.entrypoint == (PY, "-u", "train.py", "a")


def test_module_no_python_and_run_path_entrypoints() -> None:
    assert build("-m", "pkg.train", "--lr=1").agent.entrypoint == (
        PY,
        "-u",
        "-m",
        "pkg.train",
        "--lr=1",
    )
    assert build("--no-python", "./run.sh", "a").agent.entrypoint == ("./run.sh", "a")
    assert build("--run-path", "--no_python", "/a/t.py").agent.entrypoint == (PY, "-u", "/a/t.py")
    assert "--module" in config_error("--no-python", "--module", "x")
    assert build("x", env={"PYTHON_EXEC": "/opt/py"}).agent.entrypoint == ("/opt/py", "-u", "x")
    assert "missing SCRIPT" in config_error("--nnodes=1")


def test_nproc_device_words_and_omp_threads() -> None:
    config = build("--nproc-per-node=gpu", "x", devices=lambda kind: {"gpu": 8}[kind])
    assert config.agent.nproc_per_node == 8
    assert dict(config.agent.extra_env) == {"OMP_NUM_THREADS": "1"}
    assert build("--nproc-per-node=cpu", "x").agent.nproc_per_node >= 1
    config = build("--nproc-per-node=4", "x", env={"OMP_NUM_THREADS": "8"})
    assert dict(config.agent.extra_env) == {}

    def no_cuda(kind: str) -> int:
        raise ValueError("CUDA is not available")

    with pytest.raises(ConfigError, match="gpu: CUDA is not available"):
        build("--nproc-per-node=gpu", "x", devices=no_cuda)
    for bad in ("0", "-1", "tpu", "1.5"):
        assert "--nproc-per-node" in config_error(f"--nproc-per-node={bad}", "x")


def test_redirects_tee_and_rank_filters() -> None:
    agent = build("--nproc-per-node=2", "-r", "3", "-t0:1,1:2", "--local-ranks-filter=0", "x").agent
    assert dict(agent.redirects) == {0: 3, 1: 3}
    assert dict(agent.tee) == {0: 1, 1: 2}
    assert agent.local_ranks_filter == frozenset({0})
    agent = build("--duplicate-stdout-filters=a,,b,c", "--duplicate_stderr_filters=,", "x").agent
    assert agent.duplicate_stdout_filters == ("a,b", "c")
    assert agent.duplicate_stderr_filters == ("", "")  # torchrun's split: "" matches every line
    assert "--redirects" in config_error("--redirects=4", "x")
    assert "--tee" in config_error("--tee=0:1,x", "x")
    assert "--local-ranks-filter" in config_error("--local-ranks-filter=0,a", "x")
    assert "--numa-binding" in config_error("--numa-binding=all", "x")
    assert "--logs-specs" in config_error("--logs-specs=mine", "x")


def test_signals_and_stop_timeouts() -> None:
    for spelling in ("SIGUSR1", "usr1", str(int(signal.SIGUSR1))):
        agent = build(f"--ft-rank-termination-signal={spelling}", "x").agent
        assert agent.termination_signal is signal.SIGUSR1
    assert "unknown signal" in config_error("--ft-rank-termination-signal=SIGNOPE", "x")
    assert build("--signals-to-handle=TERM,USR2", "x").agent.signals_to_handle == (
        signal.SIGTERM,
        signal.SIGUSR2,
    )
    assert "SIGKILL" in config_error("--signals-to-handle=SIGTERM,SIGKILL", "x")
    assert build("--shutdown-timeout=7", "x").agent.workers_stop_timeout == 7.0
    assert "disagree" in config_error("--shutdown-timeout=7", "--workers-stop-timeout=3", "x")
    assert "--workers-stop-timeout" in config_error("--workers-stop-timeout=-1", "x")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--max-restarts=-1"], "--max-restarts"),
        (["--monitor-interval=0"], "--monitor-interval"),
        (["--ft-safety-factor=0"], "--ft-safety-factor"),
        (["--ft-rank-heartbeat-timeout=0"], "--ft-rank-heartbeat-timeout"),
        (["--ft-initial-rank-heartbeat-timeout=-3"], "--ft-initial-rank-heartbeat-timeout"),
        (["--ft-gpu-memory-tolerance-mb=lots"], "--ft-gpu-memory-tolerance-mb"),
        (["--ft-log-level=chatty"], "--ft-log-level"),
        (["--master-port=65536", "--nnodes=2"], "--master-port"),
        (["--start-method=thread"], "--start-method"),
    ],
)
def test_bad_values_name_their_flag(argv: list[str], flag: str) -> None:
    assert config_error(*argv, "x").startswith(flag)


def test_click_usage_errors_are_config_errors() -> None:
    assert "--bogus" in config_error("--bogus", "x")
    assert "--nnodes" in config_error("--nnodes")


# --- fault-tolerance options -----------------------------------------------------------------


def test_timeouts_and_section_timeouts() -> None:
    monitor = build(
        "--ft-rank-section-timeouts=step:30,ckpt:none, eval : 2.5",
        "--ft-rank-out-of-section-timeout=600",
        "--ft-rank-heartbeat-timeout=NULL",
        "x",
    ).monitor
    assert dict(monitor.rank_section_timeouts) == {"step": 30.0, "ckpt": None, "eval": 2.5}
    assert monitor.rank_out_of_section_timeout == 600.0
    assert monitor.rank_heartbeat_timeout is None
    for bad in ("step", "step:abc", ":3", "step:0"):
        assert "--ft-rank-section-timeouts" in config_error(
            f"--ft-rank-section-timeouts={bad}", "x"
        )


def test_yaml_keys_are_nvrx_names() -> None:
    nvrx_only = {opt.yaml_key for opt in NVRX_OPTIONS if opt.yaml_key}
    # NVRx's names of ftrun's keys
    nvrx_spellings = {"storage_healthcheck_path", "node_health_check_interval"}
    assert set(YAML_KEYS) == NVRX_YAML_KEYS | nvrx_only | nvrx_spellings


def test_yaml_nested_section_with_cli_override(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
model: {layers: 2}
training:
  - name: first
    settings:
      fault_tolerance:
        rank_heartbeat_timeout: 30
        initial_rank_heartbeat_timeout: null
        rank_section_timeouts: {step: 10, ckpt: null}
        rdzv_impl: legacy
        workers_stop_timeout: 5
        gpu_health_check: false
        storage_health_check_path: [/a, /b]
        rank_termination_signal: SIGINT
        log_level: debug
        use_infra_group_rank: true
""",
    )
    config = build(f"--ft-cfg-path={path}", "--ft-rank-heartbeat-timeout=60", "x")
    assert config.monitor.rank_heartbeat_timeout == 60.0  # CLI beats YAML
    assert config.monitor.initial_rank_heartbeat_timeout is None
    assert dict(config.monitor.rank_section_timeouts) == {"step": 10.0, "ckpt": None}
    assert config.rendezvous.impl is RendezvousImpl.DYNAMIC
    assert config.rendezvous.use_infra_group_rank is True
    assert config.agent.workers_stop_timeout == 5.0
    assert config.agent.termination_signal is signal.SIGINT
    assert config.health == HealthCheckConfig(gpu=False, storage_paths=("/a", "/b"))
    assert config.log_level == "DEBUG"
    assert build(f"--ft_cfg_path={path}", "--ft-gpu-health-check", "x").health.gpu is True


def test_yaml_errors_are_one_line(tmp_path: Path) -> None:
    bad_key = write_yaml(tmp_path, "fault_tolerance:\n  rank_heartbeat_timout: 3\n")
    message = config_error(f"--ft-cfg-path={bad_key}", "x")
    assert "rank_heartbeat_timout" in message
    assert "did you mean rank_heartbeat_timeout" in message
    bad_value = write_yaml(tmp_path, "a:\n  fault_tolerance:\n    safety_factor: -1\n")
    assert "fault_tolerance.safety_factor" in config_error(f"--ft-cfg-path={bad_value}", "x")
    missing = str(tmp_path / "absent.yaml")
    assert "absent.yaml" in config_error(f"--ft-cfg-path={missing}", "x")
    broken = write_yaml(tmp_path, "fault_tolerance: [unclosed\n")
    assert "bad YAML" in config_error(f"--ft-cfg-path={broken}", "x")
    nothing = write_yaml(tmp_path, "training: {fault_tolerance: true}\n")
    assert "no 'fault_tolerance:'" in config_error(f"--ft-cfg-path={nothing}", "x")
    two = write_yaml(tmp_path, "a: {fault_tolerance: {}}\nb: {fault_tolerance: {}}\n")
    assert "several" in config_error(f"--ft-cfg-path={two}", "x")


def test_yaml_alias_to_one_section_counts_once(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "base: &ft {safety_factor: 2}\nfault_tolerance: *ft\nloop: &l [*l]\n",
    )
    assert build(f"--ft-cfg-path={path}", "x").monitor.safety_factor == 2.0


# --- environment -----------------------------------------------------------------------------


def test_pet_environment_sits_between_cli_and_defaults() -> None:
    env = {
        "PET_NPROC_PER_NODE": "3",
        "PET_MAX_RESTARTS": "2",
        "PET_NNODES": "2",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "node0:5",
        "PET_MODULE": "1",
        "PET_STANDALONE": "0",
        "PET_ROLE": "",  # empty means unset
    }
    config = build("--max-restarts=5", "pkg", env=env)
    assert (config.agent.nproc_per_node, config.agent.max_restarts) == (3, 5)
    assert config.agent.entrypoint == (PY, "-u", "-m", "pkg")
    assert config.agent.role == "default"
    assert (config.rendezvous.max_nodes, config.rendezvous.endpoint) == (2, "node0:5")
    assert build("x", env={"PET_STANDALONE": "1"}).rendezvous.endpoint == "127.0.0.1:0"
    assert config_error("x", env={"PET_MAX_RESTARTS": "many"}).startswith("PET_MAX_RESTARTS")


# --- no option silently does nothing ---------------------------------------------------------

# Per option: (base argv, argv added); what is added must change the config, warn, or be refused.
EFFECTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "nnodes": ((), ("--nnodes=2",)),
    "nproc_per_node": ((), ("--nproc-per-node=2",)),
    "rdzv_backend": ((), ("--rdzv-backend=c10d",)),
    "rdzv_endpoint": ((), ("--rdzv-endpoint=h:1",)),
    "rdzv_id": (("--nnodes=2",), ("--rdzv-id=job",)),
    "rdzv_conf": ((), ("--rdzv-conf=join_timeout=5",)),
    "standalone": (("--master-port=5",), ("--standalone",)),
    "max_restarts": ((), ("--max-restarts=1",)),
    "monitor_interval": ((), ("--monitor-interval=1",)),
    "start_method": ((), ("--start-method=fork",)),
    "event_log_handler": ((), ("--event-log-handler=console",)),
    "role": ((), ("--role=trainer",)),
    "module": ((), ("-m",)),
    "no_python": ((), ("--no-python",)),
    "run_path": (("--no-python",), ("--run-path",)),
    "log_dir": ((), ("--log-dir=/tmp/logs",)),
    "redirects": ((), ("-r3",)),
    "tee": ((), ("-t3",)),
    "local_ranks_filter": ((), ("--local-ranks-filter=0",)),
    "duplicate_stdout_filters": ((), ("--duplicate-stdout-filters=loss",)),
    "duplicate_stderr_filters": ((), ("--duplicate-stderr-filters=loss",)),
    "node_rank": (("--nnodes=2",), ("--node-rank=1",)),
    "master_addr": (("--nnodes=2",), ("--master-addr=h",)),
    "master_port": ((), ("--master-port=5",)),
    "local_addr": ((), ("--local-addr=h",)),
    "logs_specs": ((), ("--logs-specs=mine",)),
    "numa_binding": ((), ("--numa-binding=node",)),
    "signals_to_handle": ((), ("--signals-to-handle=SIGTERM",)),
    "shutdown_timeout": ((), ("--shutdown-timeout=3",)),
    "virtual_local_rank": ((), ("--virtual-local-rank",)),
    "cfg_path": ((), ("--ft-cfg-path=YAML",)),
    "metrics_port": ((), ("--ft-metrics-port=0",)),
    "status_port": ((), ("--ft-status-port=9000",)),
    "status_bind": ((), ("--ft-status-bind=0.0.0.0",)),
    "initial_rank_heartbeat_timeout": ((), ("--ft-initial-rank-heartbeat-timeout=5",)),
    "rank_heartbeat_timeout": ((), ("--ft-rank-heartbeat-timeout=5",)),
    "rank_section_timeouts": ((), ("--ft-rank-section-timeouts=step:5",)),
    "rank_out_of_section_timeout": ((), ("--ft-rank-out-of-section-timeout=5",)),
    "safety_factor": ((), ("--ft-safety-factor=2",)),
    "workload_check_interval": ((), ("--ft-workload-check-interval=1",)),
    "num_warmup_iterations": ((), ("--ft-num-warmup-iterations=2",)),
    "rank_termination_signal": ((), ("--ft-rank-termination-signal=SIGINT",)),
    "workers_stop_timeout": ((), ("--workers-stop-timeout=3",)),
    "rdzv_impl": ((), ("--ft-rdzv-impl=dynamic",)),
    "use_infra_group_rank": ((), ("--ft-use-infra-group-rank",)),
    "max_no_progress_cycles": ((), ("--ft-max-no-progress-cycles=0",)),
    "log_level": ((), ("--ft-log-level=DEBUG",)),
    "node_health_check_cmd": ((), ("--ft-node-health-check-cmd=true",)),
    "storage_health_check_path": ((), ("--ft-storage-health-check-path=/tmp",)),
    "gpu_health_check": ((), ("--ft-no-gpu-health-check",)),
    "gpu_health_check_nvlink": ((), ("--ft-gpu-health-check-nvlink",)),
    "enable_nic_healthcheck": ((), ("--ft-enable-nic-healthcheck",)),
    "nic_sysfs_root": (("--ft-enable-nic-healthcheck",), ("--ft-nic-sysfs-root=/tmp/ib",)),
    "gpu_memory_reclaim_timeout": ((), ("--ft-gpu-memory-reclaim-timeout=5",)),
    "gpu_memory_tolerance_mb": (
        ("--ft-gpu-memory-reclaim-timeout=5",),
        ("--ft-gpu-memory-tolerance-mb=1",),
    ),
    "prewarm_modules": ((), ("--ft-prewarm-modules=none",)),
    "prewarm_deep_modules": ((), ("--ft-prewarm-deep-modules=none",)),
    "prestart_workers": ((), ("--ft-prestart-workers=on",)),
    "straggler_detection": ((), ("--ft-no-straggler-detection",)),
    "straggler_report_interval": ((), ("--ft-straggler-report-interval=5",)),
    "straggler_gpu_relative_threshold": ((), ("--ft-straggler-gpu-relative-threshold=0.5",)),
    "straggler_gpu_individual_threshold": ((), ("--ft-straggler-gpu-individual-threshold=0.5",)),
    "straggler_section_relative_threshold": (
        (),
        ("--ft-straggler-section-relative-threshold=0.5",),
    ),
    "straggler_section_individual_threshold": (
        (),
        ("--ft-straggler-section-individual-threshold=0.5",),
    ),
    "straggler_action": ((), ("--ft-straggler-action=exclude",)),
    "max_same_failure": ((), ("--ft-max-same-failure=0",)),
    "inprocess_max_restarts": ((), ("--ft-inprocess-max-restarts=5",)),
    "inprocess_restart_window": ((), ("--ft-inprocess-restart-window=30",)),
    "inprocess_abort_timeout": ((), ("--ft-inprocess-abort-timeout=5",)),
    "health_interval": ((), ("--ft-health-interval=1",)),
    "health_action": ((), ("--ft-health-action=log",)),
    "attribution_stop_action": ((), ("--ft-attribution-stop-action=no-restart",)),
    "no_restart_exit_code": ((), ("--ft-no-restart-exit-code=93",)),
    "store_reconnect_timeout": (
        ("--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "--nnodes=2"),
        ("--ft-store-reconnect-timeout=30",),
    ),
    # NVRx-only options: each is refused (tests/compat/test_launcher_options.py)
    **{opt.name: ((), (f"{opt.label}=x",)) for opt in NVRX_OPTIONS},
    # a number (accepted where it equals --workers-stop-timeout): tests/test_nvrx_config.py
    "term_timeout": ((), ("--term-timeout=5",)),
}


def _comparable(config: LaunchConfig) -> LaunchConfig:
    """The config less what differs between two builds of the same argv (a local store's
    random run id)."""
    if config.rendezvous.endpoint != "127.0.0.1:0":
        return config
    return dataclasses.replace(config, rendezvous=dataclasses.replace(config.rendezvous, run_id=""))


def test_every_option_is_in_effects() -> None:
    assert set(EFFECTS) == set(BY_NAME)


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda opt: opt.name)
def test_every_option_changes_the_config_warns_or_is_refused(
    opt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No NVML here: --numa-binding's plan is made up (test_numa.py reads a fake NVML).
    monkeypatch.setattr(build_module, "plan_launch", lambda *a: NumaPlan("node", ()))
    yaml_file = write_yaml(tmp_path, "fault_tolerance: {safety_factor: 2}\n")
    base, added = EFFECTS[opt.name]
    added = tuple(arg.replace("YAML", yaml_file) for arg in added)
    before = _comparable(build(*base, "x"))
    try:
        after = _comparable(build(*base, *added, "x"))
    except ConfigError as err:
        assert opt.rejected, f"{opt.label}: {err}"
        assert str(err).startswith(f"{opt.label}: not supported: "), err
        return
    assert after != before, f"{opt.label} has no effect"
    if opt.ignored:
        assert after.warnings[-1:] == (
            f"{opt.label} is accepted for torchrun compatibility and ignored: {opt.ignored}",
        )


def test_ignored_options_warn_when_set_from_the_environment_too() -> None:
    config = build("x", env={"PET_START_METHOD": "fork", "PET_EVENT_LOG_HANDLER": "console"})
    assert [note.split(" ")[0] for note in config.warnings] == [
        "PET_START_METHOD",
        "PET_EVENT_LOG_HANDLER",
    ]
    assert "--start-method" in config_error("--start-method=thread", "x")  # still checked
    assert build("--start-method=spawn", "x").warnings  # set, even to the default


def test_unsupported_options_say_what_to_use_instead() -> None:
    message = config_error("--numa-binding=core-complex", "x")
    assert message.startswith("--numa-binding=core-complex: not supported: ")
    assert "--numa-binding=exclusive" in message
    assert "--numa-binding" in config_error("--numa_binding=all", "x")
    assert config_error("--logs-specs=mine", "x").startswith("--logs-specs: not supported: ")


def test_virtual_local_rank_needs_one_visible_gpu_per_worker() -> None:
    assert build("--virtual-local-rank", "x").agent.virtual_local_rank is True
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    agent = build("--nproc-per-node=2", "--virtual-local-rank", "x", env=env).agent
    assert agent.virtual_local_rank is True
    assert config_error("--nproc-per-node=3", "--virtual-local-rank", "x", env=env) == (
        "--virtual-local-rank gives each of the 3 workers one GPU of CUDA_VISIBLE_DEVICES=4,5,"
        " which names 2"
    )
    assert build("--nproc-per-node=3", "x", env=env).agent.virtual_local_rank is False
    env = {"PET_VIRTUAL_LOCAL_RANK": "1"}
    assert build("x", env=env).agent.virtual_local_rank is True


def test_rdzv_conf_keys_are_used_ignored_with_a_warning_or_refused() -> None:
    def warnings(conf: str, *more: str) -> tuple[str, ...]:
        return build("--rdzv-backend=c10d", f"--rdzv-conf={conf}", *more, "x").warnings

    assert warnings("keep_alive_interval=3,timeout=9") == (
        "--rdzv-conf keep_alive_interval: read by torch's rendezvous, not ftrun's; ignored",
        "--rdzv-conf timeout: read by torch's rendezvous, not ftrun's; ignored",
    )
    assert warnings("close_timeout=3") == (
        "--rdzv-conf close_timeout is only used by --ft-rdzv-impl=dynamic; ignored",
    )
    assert warnings("close_timeout=3", "--ft-rdzv-impl=dynamic") == ()
    assert build("--rdzv-conf=is_host=0", "x").warnings == (
        "--rdzv-conf is_host is ignored: this node serves its own local store",
    )
    message = config_error("--rdzv-conf=join_timout=60", "x")
    assert message.startswith("--rdzv-conf: unknown key 'join_timout' (did you mean join_timeout?")
    assert "read_timeout" in config_error("--rdzv-conf=read_timeout=soon", "x")


def test_flags_that_a_local_store_makes_moot_are_named() -> None:
    assert build("--master-addr=h", "--rdzv-id=j", "x").warnings == (
        "--rdzv-id, --master-addr ignored: one static node without --master-port uses a local"
        " store",
    )
    config = build("--nnodes=2", "--rdzv-endpoint=h:1", "--master-port=7", "x")
    assert config.warnings == ("--master-port ignored: --rdzv-endpoint names the store",)


def test_moot_gpu_options_warn() -> None:
    assert build("--ft-no-gpu-health-check", "--ft-gpu-health-check-nvlink", "x").warnings == (
        "--ft-gpu-health-check-nvlink is ignored: the GPU health check is off",
    )
    assert build("--ft-gpu-memory-tolerance-mb=1", "x").warnings == (
        "--ft-gpu-memory-tolerance-mb is ignored: --ft-gpu-memory-reclaim-timeout is 0 (off)",
    )


NOT_READ_ON_PURPOSE = {"RendezvousConfig.backend"}
"""--rdzv-backend acts while the config is built (which store, which node rank)."""


def test_every_config_field_is_read_somewhere() -> None:
    """A value the launcher parses and stores but nothing reads is an option that does nothing."""
    root = Path(__file__).resolve().parents[1] / "src" / "ftrun"
    builder = root / "ft_launcher" / "config.py"
    code = "\n".join(path.read_text() for path in sorted(root.rglob("*.py")) if path != builder)
    classes = (LaunchConfig, AgentConfig, RendezvousConfig, RankMonitorConfig, HealthCheckConfig)
    unread = {
        f"{cls.__name__}.{field.name}"
        for cls in classes
        for field in dataclasses.fields(cls)
        if not re.search(rf"\.{field.name}\b", code)
    }
    assert unread - NOT_READ_ON_PURPOSE == set(), "parsed, stored, never read"


# --- main ------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def fake_agent(monkeypatch: pytest.MonkeyPatch, run_node: Any) -> None:
    """Run `main` in this process: a fake agent, sys.exit for os._exit, pytest's signals kept."""
    fake = types.SimpleNamespace(run_node=lambda config, *_rest: run_node(config))
    monkeypatch.setitem(sys.modules, "ftrun.agent", fake)
    monkeypatch.setattr(cli, "_leave", sys.exit)
    monkeypatch.setattr(signal, "signal", lambda *_: None)


def test_main_runs_the_node_with_the_config(
    monkeypatch: pytest.MonkeyPatch, restore_logging: None, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()  # a script that is not there is a usage error
    seen: list[LaunchConfig] = []
    fake_agent(monkeypatch, lambda config: seen.append(config) or ExitCode.PREEMPTED)
    with pytest.raises(SystemExit) as info:
        cli.main(["--ft-log-level=warning", "train.py", "a"])
    assert info.value.code == ExitCode.PREEMPTED
    assert seen[0].agent.entrypoint == (PY, "-u", "train.py", "a")
    assert logging.getLogger().level == logging.WARNING


def test_main_turns_ftrun_errors_into_their_exit_code(
    monkeypatch: pytest.MonkeyPatch, restore_logging: None, tmp_path: Path
) -> None:
    def run_node(config: LaunchConfig) -> ExitCode:
        raise FtrunError("spent")

    fake_agent(monkeypatch, run_node)
    with pytest.raises(SystemExit) as info:
        cli.main([str(tmp_path)])  # a directory is no script: a usage error, checked first
    assert info.value.code == ExitCode.USAGE
    (tmp_path / "x").touch()
    with pytest.raises(SystemExit) as info:
        cli.main([str(tmp_path / "x")])
    assert info.value.code == ExitCode.FAILED


def test_main_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    assert "--ft-rank-section-timeouts" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["--nnodes=0", "x"])
    assert info.value.code == ExitCode.USAGE
    assert (
        capsys.readouterr().err == "ft_launcher: error: --nnodes: need 1 <= MIN <= MAX, got '0'\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--ft-rank-heartbeat-timeout=abc", "x.py"],
        ["--ft-cfg-path=BAD", "x.py"],
        ["--no-such-flag", "x.py"],
        ["--numa-binding=node", "x.py"],
    ],
    ids=["bad-value", "bad-yaml", "unknown-flag", "unsupported"],
)
def test_usage_errors_exit_2_with_one_line(
    tmp_path: Path, argv: Sequence[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (`cli.main` exits before anything starts); the whole command in a
    subprocess is the fault matrix's (tests/faults/test_fault_config.py)."""
    bad_yaml = write_yaml(tmp_path, "fault_tolerance:\n  safety_factor: [1\n")
    argv = [arg.replace("BAD", bad_yaml) for arg in argv]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ft_launcher: error: ")
    assert "Traceback" not in err


def test_the_etcd_backend_takes_a_list_of_members() -> None:
    config = build("--nnodes=2", "--rdzv-backend=etcd", "--rdzv-endpoint=e1,e2:2380", "x")
    assert (config.rendezvous.backend, config.rendezvous.endpoint) == ("etcd", "e1:2379,e2:2380")
    assert "--rdzv-endpoint" in config_error("--rdzv-backend=etcd", "--rdzv-endpoint=e1:x", "x")


def test_the_etcd_backend_without_its_client_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    message = config_error("--rdzv-backend=etcd", "--rdzv-endpoint=e1", "x")
    assert message == "--rdzv-backend=etcd needs etcd3gw: pip install 'ftrun[etcd]'"


def test_a_reconnect_window_is_for_an_external_store_only() -> None:
    multi = ("--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "--nnodes=2")
    assert (
        build(*multi, "--ft-store-reconnect-timeout=30", "x").rendezvous.store_reconnect_timeout
        == 30
    )
    assert "is_host" in config_error(
        *multi, "--rdzv-conf=is_host=true", "--ft-store-reconnect-timeout=30", "x"
    )
    local = build("--ft-store-reconnect-timeout=30", "x")
    assert local.rendezvous.store_reconnect_timeout == 0
    assert local.warnings == ("--ft-store-reconnect-timeout ignored: the store is a local store",)


def test_the_launchers_gpus_are_the_ones_its_health_checks_answer_for() -> None:
    assert build("train.py", env={"CUDA_VISIBLE_DEVICES": "2,3"}).health.gpus == "2,3"
    assert build("train.py").health.gpus is None  # unset: every GPU on the host
