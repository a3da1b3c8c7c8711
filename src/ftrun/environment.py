"""Every `FTRUN_*` environment variable, defined once: the name, who sets it, what it means.

The launcher hands most of them to its workers; a few are read by the launcher or by a
library in the training script (the Slurm template's own, `FTRUN_JOB_DIR` and the others, are
slurm/README.md's). Code names them by member (`Env.JOB_DIR`: a `str`, so
`os.environ[Env.JOB_DIR]` works), never by a string of its own, and docs/workers.md's table is
generated from `MEANINGS` (`python -m ftrun.ft_launcher.docs`). Light: no import beyond the
standard library, since training processes import it.
"""

from __future__ import annotations

import enum


class Env(enum.StrEnum):
    MONITOR_ADDR = "FTRUN_MONITOR_ADDR"
    JOB_DIR = "FTRUN_IPC_DIR"
    """The job directory (the variable keeps its first name: scripts read it)."""
    STACK_SIGNAL = "FTRUN_STACK_SIGNAL"
    CYCLE = "FTRUN_CYCLE"
    NODE = "FTRUN_NODE"
    CYCLE_INFO = "FTRUN_CYCLE_INFO"
    CKPT_DIR = "FTRUN_CKPT_DIR"
    CPU_BIND = "FTRUN_CPU_BIND"
    MEM_BIND = "FTRUN_MEM_BIND"
    INPROCESS_STORE = "FTRUN_INPROCESS_STORE"
    INPROCESS_PREFIX = "FTRUN_INPROCESS_PREFIX"
    INPROCESS_BUDGET = "FTRUN_INPROCESS_BUDGET"
    INPROCESS_ABORT_TIMEOUT = "FTRUN_INPROCESS_ABORT_TIMEOUT"
    FR_TRACE_PATH = "FTRUN_FR_TRACE_PATH"
    FINISHED_FLAG = "FTRUN_FINISHED_FLAG"
    LIGHTNING_PACKAGE = "FTRUN_LIGHTNING_PACKAGE"
    MONITOR_REQUEST_TIMEOUT = "FTRUN_MONITOR_REQUEST_TIMEOUT"
    NIC_SYSFS_ROOT = "FTRUN_NIC_SYSFS_ROOT"


MEANINGS: dict[Env, str] = {
    Env.MONITOR_ADDR: "set for each worker: `ipc://` address of the node's RankMonitorServer "
    "(in the job directory)",
    Env.JOB_DIR: "set for each worker: the job directory, private to the job's user (0700, "
    "`$TMPDIR/ftrun-job-*`, removed when the launcher ends; a killed launcher's, by the next "
    "launcher of the same user); stack dumps are written under `stacks/`. Not "
    "`FTRUN_JOB_DIR`: slurm/ftrun.sbatch's name for the job's shared directory",
    Env.STACK_SIGNAL: "set for each worker: the signal (its number) on which the client dumps "
    "all Python stacks (faulthandler)",
    Env.CYCLE: "set for each worker: the job-wide cycle number (same on every node; also "
    "`TORCHELASTIC_RESTART_COUNT`)",
    Env.NODE: "set for each worker: this node's name in events and logs",
    Env.CYCLE_INFO: "set for each worker: the cycle's info file (JSON, in the job directory)",
    Env.CKPT_DIR: "set for each worker: the node's checkpoint directory (the checkpoint "
    "keeper's, 0700, in node memory `/dev/shm`, kept across restarts)",
    Env.CPU_BIND: "set for each worker with `--numa-binding`: its logical CPUs (cpulist)",
    Env.MEM_BIND: "set for each worker with `--numa-binding`: the NUMA nodes its memory comes "
    "from (cpulist)",
    Env.INPROCESS_STORE: "set for each worker where the job's store is the launchers' c10d "
    "TCPStore (not etcd, not `ftrun store`): its `host:port`, where `ftrun.inprocess` ranks "
    "coordinate",
    Env.INPROCESS_PREFIX: "set for each worker with `FTRUN_INPROCESS_STORE`: this cycle's key "
    "prefix in it",
    Env.INPROCESS_BUDGET: "set for each worker: the in-process restart budget, "
    "`RESTARTS/WINDOW_S/SAME` (`--ft-inprocess-max-restarts`, `--ft-inprocess-restart-window`, "
    "`--ft-max-same-failure`)",
    Env.INPROCESS_ABORT_TIMEOUT: "set for each worker: seconds an in-process abort may take "
    "(`--ft-inprocess-abort-timeout`, which the launcher also reads from its own environment; "
    "a wrapped rank without a launcher reads it too)",
    Env.FR_TRACE_PATH: "read by `ftrun.inprocess`'s abort: where torch's flight recorder dumps "
    "(NVRx's `NVRX_FR_TRACE_PATH` too)",
    Env.FINISHED_FLAG: "set for each worker by slurm/ftrun.sbatch (its `--ft-finished-flag`; "
    "empty with `none`), read by the Lightning callback: the file that marks a finished job",
    Env.LIGHTNING_PACKAGE: "read by `ftrun.lightning`: `lightning` or `pytorch_lightning`, "
    "when both are installed",
    Env.MONITOR_REQUEST_TIMEOUT: "read by RankMonitorClient (when imported): seconds a request "
    "to the node's monitor may take (default 30)",
    Env.NIC_SYSFS_ROOT: "read by the launcher: the NIC check's sysfs root (`--ft-nic-sysfs-root`)",
}


def table() -> str:
    """The Markdown table of every variable (docs/workers.md)."""
    rows = [f"| `{name.value}` | {MEANINGS[name]} |" for name in Env]
    return "\n".join(["| variable | meaning |", "|---|---|", *rows]) + "\n"
