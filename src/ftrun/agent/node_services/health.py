"""Node health checks run before every rendezvous round: GPUs (NVML), InfiniBand ports
(`ftrun.infiniband`), storage, a command.

NVML comes from `nvml` (loaded lazily, replaced by a fake in tests).
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any

from ftrun.agent.termination import kill_group_now
from ftrun.aside import Aside
from ftrun.config.agent import HealthCheckConfig
from ftrun.errors import NodeUnhealthyError
from ftrun.infiniband import check_ib_ports
from ftrun.nvml import memory_problems, nvlinks_down, nvml_session, uncorrected_ecc, visible_gpus
from ftrun.services import Emit, NodeService

log = logging.getLogger("ftrun.agent")
_gpu_skip_logged = False
_REAP_S = 2.0
"""After SIGKILL to the health command's group: how long to wait for its shell to be reaped."""
_OUTPUT_TAIL = 4096
"""Bytes of the health command's output read for the error line."""


def check_node(config: HealthCheckConfig) -> dict[str, Any]:
    """Raise NodeUnhealthyError when this node must not run workers; else a report for events."""
    report: dict[str, Any] = {}
    if config.gpu:
        report["gpus"] = check_gpus(config.nvlink, config.gpus)
    if config.nic:
        report.update(check_ib_ports(config.nic_sysfs_root))
    for path in config.storage_paths:
        _within(config.storage_timeout, f"storage {path}", lambda p=path: _read_path(p))
    report["storage_paths"] = len(config.storage_paths)
    if config.command:
        _run_command(config.command, config.command_timeout)
        report["command"] = "ok"
    return report


def check_gpus(nvlink: bool = False, visible: str | None = None) -> int:
    """Every GPU of this launcher's workers (those `visible`, its CUDA_VISIBLE_DEVICES, names;
    None: every GPU NVML sees) must answer and report no pending page retirement, row remapping
    failure or uncorrected (XID-class) ECC errors. Returns the GPU count (0: skipped)."""
    global _gpu_skip_logged
    with nvml_session() as pynvml:
        if pynvml is None:
            if not _gpu_skip_logged:  # no library, no driver: a node without GPUs
                log.info("GPU health check skipped: NVML unavailable")
                _gpu_skip_logged = True
            return 0
        try:
            gpus = visible_gpus(pynvml, visible)
            for index, handle in gpus:
                _check_device(pynvml, index, handle, nvlink)
        except pynvml.NVMLError as exc:
            raise NodeUnhealthyError(f"NVML query failed: {exc}") from None
        except LookupError as exc:
            raise NodeUnhealthyError(str(exc)) from None
        return len(gpus)


def _check_device(pynvml: Any, index: int, handle: Any, nvlink: bool) -> None:
    problems = memory_problems(pynvml, handle)
    ecc = uncorrected_ecc(pynvml, handle)
    if ecc:
        problems.append(f"{ecc} uncorrected ECC errors")
    down = nvlinks_down(pynvml, handle) if nvlink else []
    if down:
        problems.append(f"NVLink(s) {down} down")
    if problems:
        raise NodeUnhealthyError(f"GPU {index}: {', '.join(problems)}")


def _read_path(path: str) -> None:
    if os.path.isdir(path):
        os.listdir(path)
    else:
        with open(path, "rb") as f:
            f.read(1)


def _within(timeout: float, what: str, check: Callable[[], None]) -> None:
    """Run `check` aside: a hung network filesystem must not hang the agent."""
    call = Aside(check, f"health-{what}")
    if not call.done(timeout):
        raise NodeUnhealthyError(f"{what}: no answer within {timeout:g}s")
    try:
        call.result()
    except BaseException as exc:
        raise NodeUnhealthyError(f"{what}: {exc}") from None


def _run_command(command: str, timeout: float) -> None:
    """Run the operator's health command; every wait is bounded.

    Its output goes to an unlinked file, not a pipe: a process the command starts in a session
    of its own (a daemon, `setsid cmd &`) escapes the group kill and would hold a pipe open for
    as long as it lives, so reading a pipe to its end could block the agent. The agent waits on
    the command's shell alone, with a deadline, and reads the file's tail once it is gone."""
    with tempfile.TemporaryFile() as output:
        # A session of its own, so that a timeout takes the command's children too.
        proc = subprocess.Popen(command, shell=True, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # The command's group only: `terminate` would also take the agent's other children
            # (the fork server) for orphans.
            kill_group_now(proc.pid)
            _reap(proc)
            raise NodeUnhealthyError(f"health command timed out after {timeout:g}s") from None
        if code != 0:
            raise NodeUnhealthyError(f"health command exited {code}: {_last_line(output)}")


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait, bounded, for the killed command's shell; one that stays (uninterruptible sleep on
    a hung mount dies only when its I/O returns) is logged and left to the next reap."""
    try:
        proc.wait(timeout=_REAP_S)
    except subprocess.TimeoutExpired:
        log.warning("health command (pid %d) still there %gs after SIGKILL; going on without it",
                    proc.pid, _REAP_S)  # fmt: skip


def _last_line(output: IO[bytes]) -> str:
    """The last line of what the command wrote (its tail only: it may have written a lot)."""
    size = output.seek(0, os.SEEK_END)
    output.seek(max(size - _OUTPUT_TAIL, 0))
    lines = output.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


class HealthService(NodeService):
    """Runs the checks before every round. The first report is taken at construction, before
    the store is met: a node that starts unhealthy must not host the store."""

    name = "health checks"

    def __init__(self, config: HealthCheckConfig, emit: Emit) -> None:
        self._config = config
        self._emit = emit
        self.first: dict[str, Any] | NodeUnhealthyError | None = self._report()

    def before_round(self) -> None:
        result, self.first = self.first or self._report(), None
        if isinstance(result, NodeUnhealthyError):
            raise result
        self._emit("health_check", **result)

    def _report(self) -> dict[str, Any] | NodeUnhealthyError:
        started = time.monotonic()
        try:
            report = check_node(self._config)
        except NodeUnhealthyError as exc:
            return exc
        return {**report, "duration": round(time.monotonic() - started, 6)}
