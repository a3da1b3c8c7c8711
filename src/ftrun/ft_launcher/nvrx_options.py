"""NVRx 0.7's launcher options that ftrun has no option of its own for, each decided once.

An NVRx or NeMo command line or YAML must not fail with "no such option": each flag of NVRx's
launcher and each `fault_tolerance:` key is either one of ftrun's options (`options.py`, often
under the same name) or declared here, refused in one line that names what to use in ftrun
instead (tests/data/nvrx_0_7_* hold NVRx 0.7's flags and the YAML it writes, and
tests/test_nvrx_config.py checks them). The migration table of docs/migrating-from-nvrx.md is
generated from these declarations (`docs.py`).
"""

from __future__ import annotations

from typing import Any

from ftrun.ft_launcher import values as v
from ftrun.ft_launcher.declare import Option, ft_option

_SPELLINGS = {False: ("false", "0", "no", "off"), True: ("true", "1", "yes", "on"),
              None: ("none", "null", "")}  # fmt: skip


def _spelled(value: Any) -> tuple[str, ...]:
    """How a value reaches the check (lower case): YAML's and NVRx's command line's spellings."""
    if isinstance(value, (bool, type(None))):
        return _SPELLINGS[value]
    if isinstance(value, float):
        return (repr(value), f"{value:g}")
    return (str(value).lower(),)


def _refused(name: str, help: str, instead: str, nvrx_default: Any = "unset", **kw: Any) -> Option:
    """An NVRx option ftrun refuses: any value parses; setting it is a one-line error, unless
    to `nvrx_default` (NVRx's own default asks for nothing, and NVRx configs often spell it; a
    tuple: several values that mean the default, as None and False for an off switch)."""
    if nvrx_default == "unset":
        defaults: tuple[Any, ...] = ()
    else:
        defaults = nvrx_default if isinstance(nvrx_default, tuple) else (nvrx_default,)
    harmless = tuple(word for value in defaults for word in _spelled(value))
    return ft_option(name, None, v.optional_text, help, rejected=instead, harmless=harmless, **kw)


_LOGS = "ftrun writes per-cycle, per-rank logs under --log-dir and prefixes console lines"
_ATTRIBUTION = (
    "ftrun attributes failures itself: `ftrun report LOG_DIR` reads the launchers' events "
    "(crash, hang with stacks, node lost)"
)

# fmt: off
NVRX_OPTIONS: tuple[Option, ...] = (
    _refused("restart_policy", "NVRx's worker group restart policy (deprecated there).",
             "ftrun restarts when any worker fails (NVRx's only policy, any-failed) and learns "
             "from the failures: --ft-max-same-failure; limit restarts with --max-restarts and "
             "--ft-max-no-progress-cycles",
             nvrx_default="any-failed"),
    _refused("install_exception_hook", "NVRx's sys.excepthook in workers that calls os._exit.",
             "not needed: ftrun sees a worker's exit when it happens and keeps its own "
             "traceback in the rank's log", nvrx_default=False),
    _refused("numa_bind_strict", "NVRx's numactl --membind vs --localalloc choice.",
             "use --numa-binding=node|socket|exclusive (memory always MPOL_BIND to the GPU's "
             "node)", nvrx_default=True),
    _refused("segment", "NVRx's rendezvous segment size (nodes that must come as a block).",
             "ftrun's rendezvous has no segments; use --nnodes=MIN:MAX and hot spares",
             nvrx_default=None),
    _refused("segment_health_check_dir", "NVRx's per-task segment health decisions.",
             "use --ft-node-health-check-cmd (a command that must exit 0 before each "
             "rendezvous); slurm/ftrun.sbatch keeps a node judged unhealthy out of the job's "
             "next relaunches (sbatch --exclude)", nvrx_default=None),
    _refused("min_progress_iterations", "NVRx's iterations a restart must gain to count.",
             "report iterations with send_heartbeat(iteration=...) and set "
             "--ft-max-no-progress-cycles", nvrx_default="1"),
    _refused("checkpoint_iteration_file", "NVRx's file holding the last checkpointed iteration.",
             "report iterations with send_heartbeat(iteration=...) and set "
             "--ft-max-no-progress-cycles", nvrx_default=None),
    _refused("node_health_check_endpoint", "NVRx's node health service socket (nvhcd).",
             "use --ft-node-health-check-cmd, --ft-gpu-health-check and "
             "--ft-enable-nic-healthcheck"),
    _refused("restart_check_interval", "NVRx's restart state polling (deprecated there).",
             "not needed: ftrun decides restarts on events, not by polling", nvrx_default=60.0),
    _refused("enable_nic_monitor", "NVRx's link_downed polling while training.",
             "use --ft-enable-nic-healthcheck (checked before each rendezvous and, every "
             "--ft-health-interval, while training)",
             nvrx_default=False),
    _refused("pci_topo_file", "NVRx's GPU/NIC topology file for the NIC monitor.",
             "use --ft-enable-nic-healthcheck (every InfiniBand port)", nvrx_default=None),
    _refused("link_down_path_template", "NVRx's sysfs path template for link_downed.",
             "use --ft-nic-sysfs-root", nvrx_default=None),
    _refused("link_state_path_template", "NVRx's sysfs path template for the link state.",
             "use --ft-nic-sysfs-root", nvrx_default=None),
    _refused("enable_dist_storage_healthcheck", "NVRx's Lustre/NFS check before rendezvous.",
             "use --ft-storage-health-check-path PATH,... (must be readable before each "
             "rendezvous)", nvrx_default=False),
    _refused("skip_section_response", "NVRx's fire-and-forget section messages.",
             "ftrun's heartbeats and sections never wait for a response", nvrx_default=True),
    _refused("gpu_memory_poll_interval", "NVRx's GPU memory poll interval during a reclaim.",
             "ftrun polls every 0.05 s; set only --ft-gpu-memory-reclaim-timeout",
             nvrx_default=2.0),
    _refused("check_remaining_processes", "NVRx's check for workers left after a stop.",
             "ftrun always stops whole process groups and verifies none is left",
             nvrx_default=False),
    _refused("ignore_missing_cfg", "NVRx's switch to run without a config.", "ftrun runs "
             "with its defaults when no --ft-cfg-path is given", in_yaml=False, nvrx_default=False,
             flag_value="true", metavar="[=VALUE]"),  # NVRx: store_true; must not eat SCRIPT
    _refused("per_cycle_applog_prefix", "NVRx's per-cycle application log path prefix.", _LOGS,
             in_yaml=False, nvrx_default=None),
    _refused("nvrx_logfile", "NVRx's launcher log file.",
             "use --log-dir (the launcher's log is in it) or redirect stderr", in_yaml=False,
             nvrx_default=None),
    *(_refused(name, f"NVRx's log aggregation server ({name}).", _LOGS, in_yaml=False,
               nvrx_default=default)
      for name, default in (("enable_log_server", (None, False)), ("log_server_port", 50051),
                            ("log_aggregator_count", 0), ("log_leaf_max_queue_chunks", -1),
                            ("log_server_log_prefix", None),
                            ("log_server_graceful_shutdown_timeout", 60.0))),
    # NVRx's to_yaml_file writes attribution_endpoint and _export_url (null); its
    # attribution_stop_action and --ft-no-restart-exit-code are ftrun's options (options.py).
    *(_refused(name, f"NVRx's attribution service ({name}).", _ATTRIBUTION, nvrx_default=default)
      for name, default in (("attribution_endpoint", None), ("attribution_startup_timeout", 20.0),
                            ("attribution_llm_api_key_file", None),
                            ("attribution_llm_base_url", None), ("attribution_llm_model", None),
                            ("attribution_analysis_backend", None),
                            ("attribution_log_level", None),
                            ("attribution_export_url", None))),
    _refused("cycle_info_dir", "NVRx's per-cycle info files.",
             "every worker gets the cycle's info file in FTRUN_CYCLE_INFO (in the job's "
             "private directory)", nvrx_default=None),
    _refused("cycle_info_job_id", "NVRx's job id in the cycle info files.",
             "the cycle info file's job_id is the rendezvous id (--rdzv-id)", nvrx_default=None),
    # NVRx's grace after a forwarded signal: ftrun's one grace (--workers-stop-timeout) serves
    # every stop, so it is what NVRx asks only where the two are set alike.
    ft_option("term_timeout", None, v.optional(v.non_negative_number),
              "NVRx's grace from a signal forwarded to the workers (preemption) to SIGKILL.",
              prefix="", in_yaml=False, metavar="SECONDS", same_as="workers_stop_timeout",
              rejected="ftrun has one grace from the stop signal to SIGKILL, for a preemption as "
              "for a restart: give it with --workers-stop-timeout (--term-timeout is accepted "
              "where it equals that)"),
)
# fmt: on
