"""Exit codes and the exception hierarchy: the contract between ftrun and the scheduler.

Only `main()` functions call `sys.exit`; everything else raises an `FtrunError` subclass that
carries the exit status it should end the launcher with.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """How an `ft_launcher` process ends; `slurm/` turns these into relaunch decisions."""

    SUCCESS = 0
    """Every worker of the job finished successfully."""
    FAILED = 1
    """The in-job restart budget is spent (or the job cannot go on); relaunching may help."""
    USAGE = 2
    """A bad flag, YAML file, environment value or script path; relaunching will not help."""
    DO_NOT_RELAUNCH = 3
    """Retrying is pointless (unhealthy node, a worker's ShutdownWorkload request): do not
    relaunch."""
    NO_PROGRESS = 4
    """`--ft-max-no-progress-cycles` cycles in a row made no progress: do not relaunch."""
    EXCLUDED = 5
    """This node left the job at a worker's ExcludeThisNode request; the job goes on without it
    (its outcome is the other launchers' codes)."""
    REPEATED_FAILURE = 6
    """The same failure in `--ft-max-same-failure` cycles in a row, on one node or many (or
    once, one NVRx's attribution stops on, with `--ft-attribution-stop-action=no-restart`):
    restarting does not cure it; do not relaunch (the report names the failure)."""
    RESUME_TO_DISAMBIGUATE = 16
    """A rejected result must be re-run on other GPUs and no standby node was there to do it
    in this job: relaunch from the checkpoint just saved (Megatron-Core's 16)."""
    FAILED_ON_RESULT_VALIDATION = 17
    """A result failed validation and re-running it elsewhere reproduced it (`fatal`): the
    re-run state machine stopped the job; do not relaunch (Megatron-Core's 17)."""
    PREEMPTED = 75
    """Stopped by SIGTERM/SIGINT (preemption, time limit): relaunch me (EX_TEMPFAIL)."""


NO_RESTART = frozenset({ExitCode.NO_PROGRESS, ExitCode.REPEATED_FAILURE})
"""NVRx 0.7's two no-restart causes, which it ends with `--ft-no-restart-exit-code` (93 there):
no progress across restarts, and attribution's STOP (ftrun's: a failure restarting does not
cure)."""


def exit_status(code: ExitCode, no_restart_exit_code: int | None) -> int:
    """The launcher's exit status for `code`: `--ft-no-restart-exit-code`, where it is set, for
    the `NO_RESTART` codes."""
    if no_restart_exit_code is not None and code in NO_RESTART:
        return no_restart_exit_code
    return int(code)


class FtrunError(Exception):
    """Base of every ftrun error; `exit_code` is what the launcher exits with."""

    exit_code: ExitCode = ExitCode.FAILED


class ConfigError(FtrunError):
    """A configuration value is invalid (CLI flag, YAML, environment)."""

    exit_code = ExitCode.USAGE


class RankMonitorClientError(FtrunError):
    """The in-worker client was misused or cannot reach its server."""


class ProtocolError(FtrunError):
    """A monitor message is malformed, oversized or of an unknown type."""


class RendezvousFailedError(FtrunError):
    """The nodes could not meet (timeout, store gone, bad infra rank)."""


class RendezvousAuthError(RendezvousFailedError):
    """The store refused this launcher (etcd authentication or permissions): no relaunch fixes
    that, the configuration does."""

    exit_code = ExitCode.USAGE


class RendezvousPrefixHeldError(RendezvousFailedError):
    """The job's keys in etcd belong to another running job with the same --rdzv-id: relaunching
    this one as it is would meet the same stranger; another id fixes it."""

    exit_code = ExitCode.USAGE


class NodeExcludedError(FtrunError):
    """This standby node was excluded from the job while it waited (a re-run found it faulty)."""

    exit_code = ExitCode.EXCLUDED


class NodeUnhealthyError(FtrunError):
    """A health check failed on this node: it must not run workers."""

    exit_code = ExitCode.DO_NOT_RELAUNCH
