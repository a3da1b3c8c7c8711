"""Every `ft_launcher` option, declared once; the click command, YAML keys and docs derive from it.

An `Option` (`declare.py`) names its flags (`--dash-case`, torchrun's `--underscore_case`, NVRx's
`--ft-mixed_case`), the environment variable (`PET_<NAME>` for torchrun's options, as torchrun
reads them), the key in the YAML `fault_tolerance:` section (fault-tolerance options), its
default, its value parser and its help. Parsing and precedence (command line, environment, YAML,
default) are `command_line.py`'s. NVRx's options that ftrun refuses are in `nvrx_options.py`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ftrun.config.agent import AgentConfig, HealthCheckConfig
from ftrun.config.monitor import RankMonitorConfig
from ftrun.config.observe import ObserveConfig
from ftrun.config.rendezvous import RendezvousConfig, RendezvousImpl
from ftrun.config.straggler import StragglerAction, StragglerConfig, threshold
from ftrun.environment import Env
from ftrun.ft_launcher import values as v
from ftrun.ft_launcher.declare import Option
from ftrun.ft_launcher.declare import default_of as _default
from ftrun.ft_launcher.declare import ft_option as _ft
from ftrun.ft_launcher.declare import torchrun_option as _torchrun
from ftrun.ft_launcher.nvrx_options import NVRX_OPTIONS

PROG = "ft_launcher"
YAML_SECTION = "fault_tolerance"


_ON = {"is_flag": True, "metavar": ""}
_SECS = {"metavar": "SECONDS|none"}
_STD = "0 none, 1 stdout, 2 stderr, 3 both; or LOCAL_RANK:N,... per local rank"
_DUP = (
    "Also append the {0} lines that reach the console and contain any of A,B (',,' is a comma; "
    "an empty item matches every line) to filtered_{0}.log in the cycle's log directory."
)
_RANKS = {"metavar": "N|RANK:N,..."}
_MONITOR, _AGENT, _HEALTH = RankMonitorConfig, AgentConfig, HealthCheckConfig
_STRAGGLER, _OBSERVE = StragglerConfig, ObserveConfig
_SCORE = "Straggler threshold: a rank whose {} score is below it is a straggler (0..1)."
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
"""torch.numa.binding.AffinityMode values (torchrun's --numa-binding choices)."""

# fmt: off
TORCHRUN_OPTIONS: tuple[Option, ...] = (
    _torchrun("nnodes", "1:1", v.nnodes, "Number of nodes, or MIN:MAX.", metavar="N|MIN:MAX"),
    _torchrun("nproc_per_node", "1", v.nproc, "Workers per node: N, auto, cpu, gpu or xpu."),
    _torchrun("rdzv_backend", "static", v.choice("static", "c10d", "etcd"), "Rendezvous "
              "backend: static (--master-addr/--master-port/--node-rank), c10d (a TCPStore on "
              "--rdzv-endpoint, served by the agent on that host) or etcd (an etcd cluster: "
              "--rdzv-endpoint=HOST:PORT,...; no training node holds the store)."),
    _torchrun("rdzv_endpoint", "", v.text, "Rendezvous store HOST[:PORT] (etcd: HOST[:PORT],... "
              "its members, port 2379 by default).", metavar="HOST:PORT"),
    _torchrun("rdzv_id", "none", v.text, "User-defined job id, the same on every node.",
              metavar="ID"),
    _torchrun("rdzv_conf", "", v.rdzv_conf, "Rendezvous K=V,...: join_timeout, "
              "last_call_timeout, close_timeout (--ft-rdzv-impl=dynamic only), read_timeout "
              "(seconds), is_host; torch's other keys are ignored with a warning, unknown keys "
              "are errors.", metavar="K=V,..."),
    _torchrun("standalone", False, v.boolean, "One node, a local store on a free port, a random "
              "run id (--rdzv-backend/-endpoint/-id are ignored, with a warning).", **_ON),
    _torchrun("max_restarts", 0, v.non_negative_int, "In-job restarts before giving up.",
              metavar="N"),
    _torchrun("monitor_interval", 0.1, v.positive_number, "Seconds between worker checks.",
              metavar="SECONDS"),
    _torchrun("start_method", "spawn", v.choice("spawn", "fork", "forkserver"),
              "How torchrun starts function entrypoints.",
              ignored="workers are always processes running the command, as torchrun runs a "
              "script"),
    _torchrun("event_log_handler", "null", v.text, "torchrun's elastic events handler.",
              ignored="ftrun writes its events to events-<node>.jsonl under --log-dir",
              metavar="NAME"),
    _torchrun("role", "default", v.text, "User-defined role of the workers.", metavar="NAME"),
    _torchrun("module", False, v.boolean, "Run SCRIPT as a module (python -m).",
              short=("-m",), **_ON),
    _torchrun("no_python", False, v.boolean, "Run SCRIPT directly, not with python.", **_ON),
    _torchrun("run_path", False, v.boolean, "Run SCRIPT with python (beats --no-python).", **_ON),
    _torchrun("log_dir", None, v.optional_text, "Directory for events and worker logs "
              "(default: a fresh /tmp/ftrun-logs-*).", metavar="DIR"),
    _torchrun("redirects", "0", v.std_spec, f"Streams to log files only: {_STD}.",
              short=("-r",), **_RANKS),
    _torchrun("tee", "0", v.std_spec, f"Streams to log files and console: {_STD}.",
              short=("-t",), **_RANKS),
    _torchrun("local_ranks_filter", "", v.rank_set, "Local ranks shown on the console (0,1); "
              "the log files keep every rank.", metavar="RANKS"),
    _torchrun("duplicate_stdout_filters", "", v.comma_list, _DUP.format("stdout"),
              metavar="A,B"),
    _torchrun("duplicate_stderr_filters", "", v.comma_list, _DUP.format("stderr"),
              metavar="A,B"),
    _torchrun("node_rank", 0, v.non_negative_int, "This node's rank (static rendezvous).",
              metavar="N"),
    _torchrun("master_addr", "127.0.0.1", v.text, "Store host, static rendezvous.", metavar="HOST"),
    _torchrun("master_port", None, v.optional_port, "Store port, static rendezvous (29500).",
              metavar="PORT"),
    _torchrun("local_addr", None, v.optional_text, "This node's address as others reach it.",
              metavar="HOST"),
    _torchrun("logs_specs", None, v.optional_text, "torchrun LogsSpecs plugin (entry point name).",
              env=None, metavar="NAME",
              rejected="ftrun writes its own per-cycle logs under --log-dir"),
    _torchrun("numa_binding", None, v.optional(v.choice(*NUMA_MODES)),
              "Bind each worker to the CPUs and memory (MPOL_BIND) near its GPU, as NVML reports "
              "them, within the launcher's own CPUs: node (the GPU's NUMA node), socket (its "
              "socket) or exclusive (a disjoint share of the node's cores per worker). "
              "core-complex is refused (NVML reports no L3 domains), and so is any mode where "
              "NVML is missing.", env=None),
    _torchrun("signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT", v.signal_list,
              "Signals caught and forwarded to the workers.", metavar="SIG,..."),
    _torchrun("shutdown_timeout", None, v.optional(v.non_negative_int),
              "torchrun's name for --workers-stop-timeout.", metavar="SECONDS"),
    _torchrun("virtual_local_rank", False, v.boolean, "LOCAL_RANK=0 in every worker, and "
              "CUDA_VISIBLE_DEVICES naming only its own GPU (entry LOCAL_RANK of the launcher's "
              "list, else LOCAL_RANK).", **_ON),
)

FT_OPTIONS: tuple[Option, ...] = (
    _ft("cfg_path", None, v.optional_text, "YAML file with a fault_tolerance: section.",
        metavar="FILE", in_yaml=False),
    _ft("initial_rank_heartbeat_timeout", _default(_MONITOR, "initial_rank_heartbeat_timeout"),
        v.timeout, "Seconds from init_workload_monitoring() to the first heartbeat.", **_SECS),
    _ft("rank_heartbeat_timeout", _default(_MONITOR, "rank_heartbeat_timeout"),
        v.timeout, "Seconds allowed between heartbeats.", **_SECS),
    _ft("rank_section_timeouts", _default(_MONITOR, "rank_section_timeouts"),
        v.section_timeouts, "Longest time inside each named section.",
        metavar="NAME:SECONDS,..."),
    _ft("rank_out_of_section_timeout", _default(_MONITOR, "rank_out_of_section_timeout"),
        v.timeout, "Seconds allowed outside any section (counted after the first section).",
        **_SECS),
    _ft("safety_factor", _default(_MONITOR, "safety_factor"), v.positive_number,
        "Calculated timeout = factor x longest observed interval.", metavar="X"),
    _ft("num_warmup_iterations", _default(_MONITOR, "num_warmup_iterations"),
        v.non_negative_int, "A rank's first N step sections are judged with the warmup section "
        "timeout (--ft-rank-section-timeouts=step:S,warmup:W), where one is given; a client's "
        "init_workload_monitoring(num_warmup_iters=) overrides it.", metavar="N"),
    _ft("workload_check_interval", _default(_MONITOR, "calculated_timeout_floor"),
        v.non_negative_number, "NVRx's rank check interval. ftrun judges hangs at the deadline, "
        "so this is the shortest timeout a rank may calculate or load from a saved state "
        "(NVRx never judges sooner than its next check); timeouts given to the launcher are "
        "judged to the millisecond.", metavar="SECONDS"),
    _ft("rank_termination_signal", _default(_AGENT, "termination_signal"), v.signal_value,
        "Signal that stops workers (SIGTERM, TERM or 15); SIGKILL follows after "
        "--workers-stop-timeout.", metavar="SIGNAL"),
    _ft("workers_stop_timeout", _default(_AGENT, "workers_stop_timeout"), v.non_negative_number,
        "Seconds from the termination signal to SIGKILL.", prefix="", metavar="SECONDS"),
    _ft("rdzv_impl", RendezvousImpl.BARRIER.value,
        v.choice(*(impl.value for impl in RendezvousImpl), aliases={"legacy": "dynamic"}),
        "Rendezvous algorithm: barrier, or dynamic (alias legacy; torch's compare-and-set "
        "state, slow at scale: see bench/RESULTS.md)."),
    _ft("use_infra_group_rank", _default(RendezvousConfig, "use_infra_group_rank"), v.boolean,
        "Rank nodes by SLURM_PROCID/SLURM_NODEID/GROUP_RANK, not arrival.", **_ON),
    _ft("store_reconnect_timeout", _default(RendezvousConfig, "store_reconnect_timeout"),
        v.non_negative_number, "c10d: the store is `ftrun store`'s (no agent serves it); after "
        "losing it, reconnect for up to SECONDS, and if it restarted empty, write the job's "
        "state back and restart the cycle. 0: losing the store ends the job.", metavar="SECONDS"),
    _ft("max_no_progress_cycles", _default(_AGENT, "max_no_progress_cycles"), v.integer,
        "Stop the job (exit 4, not relaunched) after N cycles in a row without an iteration "
        "past the best reported through the client; <= 0: off.", metavar="N"),
    _ft("max_same_failure", _default(_AGENT, "max_same_failure"), v.integer,
        "Stop the job (exit 6, not relaunched) once the same failure signature ended N cycles "
        "in a row, on one node or many (restarting does not cure it); a node leaves only when "
        "it failed the same way holding other ranks, alone both times, and the job can go on "
        "without it; <= 0: off.", metavar="N"),
    _ft("attribution_stop_action", _default(_AGENT, "attribution_stop_action"),
        v.attribution_stop_action, "NVRx's answer to a failure its attribution says a restart "
        "does not cure (an exception in the application, a CUDA error, a segmentation fault, an "
        "abort or a SIGKILL of a worker; not a hang, an NCCL error, a lost peer or a health "
        "finding): log: say so in the log (the job restarts; --ft-max-same-failure still stops "
        "it); no-restart: stop the job at its first occurrence (exit 6, or "
        "--ft-no-restart-exit-code). Not set: ftrun's own rules alone."),
    _ft("no_restart_exit_code", _default(_AGENT, "no_restart_exit_code"),
        v.optional(v.no_restart_exit_code), "Exit N instead of 4 (no progress: "
        "--ft-max-no-progress-cycles) and 6 (a failure restarting does not cure: "
        "--ft-max-same-failure, --ft-attribution-stop-action=no-restart), NVRx's two no-restart "
        "decisions (its default: 93); slurm/ftrun.sbatch does not relaunch on N. Not set: 4 and 6.",
        in_yaml=False, metavar="N"),
    _ft("inprocess_max_restarts", _default(_AGENT, "inprocess_max_restarts"), v.non_negative_int,
        "In-process restarts (ftrun.inprocess) a cycle allows within "
        "--ft-inprocess-restart-window, whoever started them, before the in-job restart; the "
        "same fault ending --ft-max-same-failure iterations in a row goes there at once; "
        "0: no limit.", metavar="N"),
    _ft("inprocess_restart_window", _default(_AGENT, "inprocess_restart_window"),
        v.positive_number, "The window of --ft-inprocess-max-restarts.", metavar="SECONDS"),
    _ft("inprocess_abort_timeout", _default(_AGENT, "inprocess_abort_timeout"),
        v.positive_number, "Seconds a wrapped rank's abort of its process groups may take "
        "before the rank gives up on in-process restart (the in-job restart follows).",
        metavar="SECONDS", env=Env.INPROCESS_ABORT_TIMEOUT.value),
    _ft("health_interval", _default(_HEALTH, "watch_interval"), v.non_negative_number,
        "While training, read GPU health from NVML (Xid events, uncorrected ECC, pending page "
        "retirement or row remapping, thermal and power-brake throttling) and, with the NIC "
        "check on, link_downed, every SECONDS; 0: only before each rendezvous (NVRx's "
        "node_health_check_interval).", metavar="SECONDS",
        aliases=("node_health_check_interval",)),
    _ft("health_action", _default(_AGENT, "health_action"), v.choice("log", "restart", "exclude"),
        "What a fault found while training does: log it; restart the job; or exclude the node "
        "(it leaves at once if a standby node or the minimum size allows, else it is logged). "
        "Throttling is always only logged."),
    _ft("log_level", "INFO", v.log_level, "Launcher log level.", metavar="LEVEL"),
    _ft("node_health_check_cmd", _default(_HEALTH, "command"), v.optional_text,
        "Command that must exit 0 before each rendezvous.", metavar="CMD"),
    _ft("storage_health_check_path", _default(_HEALTH, "storage_paths"), v.path_list,
        "Paths that must be readable before each rendezvous (NVRx's storage_healthcheck_path).",
        metavar="PATH,...", aliases=("storage_healthcheck_path",)),
    _ft("gpu_health_check", _default(_HEALTH, "gpu"), v.boolean,
        "Check GPUs through NVML before each rendezvous.", off_flags=True, **_ON),
    _ft("gpu_health_check_nvlink", _default(_HEALTH, "nvlink"), v.boolean,
        "Also require every NVLink to be up (part of the GPU check); while training, a link "
        "that goes down, or whose error counters (replay, recovery) rise in more than 15 of "
        "the last 30 minutes (NVRx's NVLinkWindowHealthCheck), is a fault.", **_ON),
    _ft("enable_nic_healthcheck", _default(_HEALTH, "nic"), v.boolean,
        "Check every InfiniBand port in sysfs before each rendezvous: state ACTIVE, physical "
        "state LinkUp, and no link_downed increase since this launcher's previous check (a "
        "flapped link). A node without InfiniBand passes.", off_flags=True, **_ON),
    _ft("nic_sysfs_root", _default(_HEALTH, "nic_sysfs_root"), v.text,
        "Directory the NIC check reads: DIR/<device>/ports/<port>/{state,phys_state,"
        "counters/link_downed} (also FTRUN_NIC_SYSFS_ROOT: one node's fake tree in tests).",
        metavar="DIR", env=Env.NIC_SYSFS_ROOT.value),
    _ft("gpu_memory_reclaim_timeout", _default(_AGENT, "gpu_memory_reclaim_timeout"),
        v.non_negative_number, "Seconds to wait for dead workers' GPU memory before a restart "
        "(0: off).", metavar="SECONDS"),
    _ft("gpu_memory_tolerance_mb", _default(_AGENT, "gpu_memory_tolerance_mb"),
        v.non_negative_number, "GPU memory (MB) still in use that counts as released (with "
        "--ft-gpu-memory-reclaim-timeout).", metavar="MB"),
    _ft("prewarm_modules", _default(_AGENT, "prewarm_modules"), v.module_list,
        "Modules the node's fork server imports once at launch, before the first cycle; every "
        "worker of every cycle is forked from it (none: spawn each worker fresh).",
        metavar="MOD,..."),
    _ft("prewarm_deep_modules", _default(_AGENT, "prewarm_deep_modules"), v.module_list,
        "Modules the fork server imports once the first cycle's workers run, for the cycles "
        "after a restart (the first cycle never waits for them; none: off).",
        metavar="MOD,..."),
    _ft("prestart_workers", "auto", v.choice("auto", "on", "off"),
        "Keep, for each local rank, its next worker forked with its CUDA context made (on "
        "cuda:LOCAL_RANK), so that a restarted rank skips that second: about 0.5 GiB of each "
        "GPU's memory while training. auto: on where NVML sees a GPU."),
    _ft("metrics_port", _default(_OBSERVE, "metrics_port"), v.optional_port,
        "Serve this agent's Prometheus metrics on PORT (0: a free port, logged and written to "
        "cycle-info.json; none: off).", metavar="PORT|none"),
    _ft("status_port", _default(_OBSERVE, "status_port"), v.optional_port,
        "The group-rank-0 agent serves the job's live status page on PORT (/ and /status.json, "
        "read-only; 0: a free port; none: off). Every agent then also publishes its events "
        "and its ranks' progress to the rendezvous store for it.", metavar="PORT|none"),
    _ft("status_bind", _default(_OBSERVE, "bind"), v.text,
        "Address the metrics and the status page listen on (0.0.0.0: every interface, for a "
        "Prometheus server or a browser on another host).", metavar="ADDR"),
    _ft("straggler_detection", _default(_STRAGGLER, "enabled"), v.boolean,
        "Score the sections that workers time with ftrun.straggler.Detector and report "
        "stragglers (costs nothing when no worker uses it).", off_flags=True, **_ON),
    _ft("straggler_report_interval", _default(_STRAGGLER, "report_interval"),
        v.optional(v.positive_number), "Seconds between straggler reports. Not given: the "
        "report_time_interval the workers give Detector.initialize (the smallest if they "
        "differ, with a warning), else 60. Given, it wins over the workers' (a warning says so "
        "if they differ).", metavar="SECONDS"),
    _ft("straggler_gpu_relative_threshold", _default(_STRAGGLER, "gpu_relative_threshold"),
        threshold, _SCORE.format("GPU relative"), metavar="X"),
    _ft("straggler_gpu_individual_threshold", _default(_STRAGGLER, "gpu_individual_threshold"),
        threshold, _SCORE.format("GPU individual"), metavar="X"),
    _ft("straggler_section_relative_threshold",
        _default(_STRAGGLER, "section_relative_threshold"), threshold,
        _SCORE.format("section relative"), metavar="X"),
    _ft("straggler_section_individual_threshold",
        _default(_STRAGGLER, "section_individual_threshold"), threshold,
        _SCORE.format("section individual"), metavar="X"),
    _ft("straggler_action", _default(_STRAGGLER, "action").value,
        v.choice(*(a.value for a in StragglerAction)),
        "What a straggler causes besides the report and a straggler event: log, stop (the job "
        "ends, exit 3) or exclude (its node leaves when the minimum size or a standby node "
        "allows; else log)."),
)
# fmt: on

OPTIONS: tuple[Option, ...] = TORCHRUN_OPTIONS + FT_OPTIONS + NVRX_OPTIONS
BY_NAME: Mapping[str, Option] = {opt.name: opt for opt in OPTIONS}
YAML_KEYS: frozenset[str] = frozenset(
    key for opt in OPTIONS for key in ((opt.yaml_key,) if opt.yaml_key else ()) + opt.yaml_aliases
)
