"""`FaultToleranceSectionsCallback`: NVRx's section-based Lightning callback (no heartbeats).

Three sections, as NVRx's: "setup" from `setup` to the first training or validation batch,
"step" around every `strategy.training_step` and `strategy.validation_step`, "checkpointing"
around `strategy.save_checkpoint`, `strategy.remove_checkpoint` and, with an async checkpoint
IO, its `maybe_finalize_save_checkpoint`; everything else is out of section. Lightning has no
hook around those calls, so, like NVRx, the callback wraps them on the trainer's strategy for
the fit; unlike NVRx it puts the originals back at the end of it.

The launcher must configure exactly those three sections (`--ft-rank-section-timeouts`, or
`rank_section_timeouts` in the YAML), as NVRx requires: `setup` raises `ValueError` otherwise.

Calculated timeouts (`calculate_timeouts=True`), NVRx's rule and file: after a step that
follows a checkpoint save, and at the end of a fit that did not fail, the sections seen enough
are recalculated ("setup" once a checkpoint was loaded, "step" after more than 16 training
steps, "checkpointing" once one was saved, synchronously), and, at the end, the out-of-section
timeout once all three were. Rank 0 keeps them in `<exp_dir>/_ft_state_.json` (default
`<trainer.log_dir>/ft_state/`), which the next fit loads.

`exc_handling_policy(exception)` returns the `WorkloadControlRequest` to send on an exception;
a `ShutdownWorkload` request also writes the finished flag (no restart after it).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ftrun.client_lib import RankMonitorClient, WorkloadAction, WorkloadControlRequest
from ftrun.client_lib.timeouts import SectionTimeouts
from ftrun.lightning._compat import Callback
from ftrun.lightning.ending import Ending, classify, finished_flag_path, write_finished_flag
from ftrun.lightning.simulated_fault import SimulatedFaultParams, current_cycle

SECTIONS = ("setup", "step", "checkpointing")


class FaultToleranceSectionsCallback(Callback):
    """NVRx's `FaultToleranceSectionsCallback(autoresume, calculate_timeouts,
    simulated_fault_params=None, exp_dir=None, logger_name=..., exc_handling_policy=None)`;
    see the module docstring. Needs ft_launcher."""

    MIN_TR_ITERS_FOR_STEP_TIMEOUT_UPDATE = 16
    TIMEOUTS_FILENAME = "_ft_state_.json"
    FT_DIR_NAME = "ft_state"

    def __init__(
        self,
        autoresume: bool,
        calculate_timeouts: bool,
        simulated_fault_params: Any = None,
        exp_dir: str | pathlib.Path | None = None,
        logger_name: str | None = "nemo_logger.FaultToleranceCallback",
        exc_handling_policy: Callable[[BaseException], WorkloadControlRequest] | None = None,
    ) -> None:
        self.logger = logging.getLogger(logger_name)
        self.autoresume = bool(autoresume)
        self.calculate_timeouts = bool(calculate_timeouts)
        self.simulated_fault_params = SimulatedFaultParams.parse(simulated_fault_params)
        self.provided_exp_dir = exp_dir
        self.exc_handling_policy = exc_handling_policy
        self.fault_tol_client: RankMonitorClient | None = None
        self.timeouts_file_path: pathlib.Path | None = None
        self._open: collections.Counter[str] = collections.Counter()
        self._unwrap: list[Callable[[], None]] = []
        self._reset_run()

    def _reset_run(self) -> None:
        self.caught_exception = False
        self.was_checkpoint_loaded = False
        self.uses_async_checkpointing = False
        self.last_checkpoint_iter = 0
        self.last_timeouts_upd_iter = 0
        self.num_tr_iters_total = 0

    @property
    def is_initialized(self) -> bool:
        return self.fault_tol_client is not None

    # ---- Lightning hooks -------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.is_initialized:
            return
        self._reset_run()
        client = RankMonitorClient()
        client.init_workload_monitoring()
        self.fault_tol_client = client
        configured = set((client.section_timeouts or SectionTimeouts()).section)
        if configured != set(SECTIONS):
            self._shutdown()
            raise ValueError(
                f"rank_section_timeouts must name exactly {list(SECTIONS)}, not "
                f"{sorted(configured)} (--ft-rank-section-timeouts)"
            )
        self.timeouts_file_path = self._ft_dir(trainer) / self.TIMEOUTS_FILENAME
        self._maybe_load_timeouts()
        self._wrap_callables(trainer)
        if self.simulated_fault_params is not None:
            seed = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{current_cycle()}"
            self.simulated_fault_params.start(trainer.global_rank, trainer.world_size, seed)
        self._start("setup")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not self.is_initialized:
            return
        self._end("setup", must_be_open=False)
        self._maybe_update_timeouts(is_final=True)
        if trainer.is_global_zero and self.autoresume:
            ending = classify(trainer)
            if ending.finished:
                self._write_flag(trainer, ending)
        self._shutdown()

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self._end("setup", must_be_open=False)
        self.num_tr_iters_total += 1

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if self.last_timeouts_upd_iter < self.last_checkpoint_iter:
            self._maybe_update_timeouts(is_final=False)
            self.last_timeouts_upd_iter = trainer.global_step

    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self._end("setup", must_be_open=False)

    def on_load_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self.was_checkpoint_loaded = True

    def on_save_checkpoint(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self.last_checkpoint_iter = trainer.global_step

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not self.is_initialized:
            return
        self.caught_exception = not (isinstance(exception, SystemExit) and not exception.code)
        self._end("setup", must_be_open=False)
        self._maybe_update_timeouts(is_final=True)
        if self.exc_handling_policy is not None:
            self._apply_policy(trainer, exception)
        self._shutdown()

    # ---- sections --------------------------------------------------------------------------

    def _start(self, name: str, allow_reopen: bool = False) -> None:
        self._open[name] += 1
        if self._open[name] == 1:
            assert self.fault_tol_client is not None
            self.fault_tol_client.start_section(name)
        elif not allow_reopen:
            raise RuntimeError(f"section {name!r} is already open")

    def _end(self, name: str, must_be_open: bool = True) -> None:
        if self._open[name] == 0:
            if must_be_open:
                raise RuntimeError(f"section {name!r} is not open")
            return
        self._open[name] -= 1
        if self._open[name] == 0 and self.fault_tol_client is not None:
            self.fault_tol_client.end_section(name)

    def _wrap_callables(self, trainer: Any) -> None:
        strategy = trainer.strategy
        self._wrap(strategy, "training_step", "step")
        self._wrap(strategy, "validation_step", "step")
        self._wrap(strategy, "save_checkpoint", "checkpointing", allow_reopen=True)
        self._wrap(strategy, "remove_checkpoint", "checkpointing", allow_reopen=True)
        io = strategy.checkpoint_io
        if hasattr(io, "maybe_finalize_save_checkpoint"):
            self.uses_async_checkpointing = True
            self._wrap(io, "maybe_finalize_save_checkpoint", "checkpointing", allow_reopen=True)

    def _wrap(self, obj: Any, method: str, section: str, allow_reopen: bool = False) -> None:
        original = getattr(obj, method)

        def in_section(*args: Any, **kwargs: Any) -> Any:
            if not self.is_initialized:
                return original(*args, **kwargs)
            self._start(section, allow_reopen)
            try:
                return original(*args, **kwargs)
            finally:
                self._end(section)

        had_own = method in vars(obj)
        setattr(obj, method, in_section)
        self._unwrap.append(
            lambda: setattr(obj, method, original) if had_own else delattr(obj, method)
        )

    # ---- timeouts --------------------------------------------------------------------------

    def _ft_dir(self, trainer: Any) -> pathlib.Path:
        if self.provided_exp_dir:
            directory = pathlib.Path(self.provided_exp_dir)
        else:
            directory = pathlib.Path(trainer.log_dir or trainer.default_root_dir) / self.FT_DIR_NAME
            if trainer.is_global_zero:
                directory.mkdir(parents=True, exist_ok=True)
            trainer.strategy.barrier()
        if not directory.is_dir():
            self._shutdown()
            raise ValueError(f"fault tolerance state directory does not exist: {directory}")
        return directory

    def _maybe_load_timeouts(self) -> None:
        path = self.timeouts_file_path
        if not self.calculate_timeouts or path is None or not path.exists():
            return
        assert self.fault_tol_client is not None
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            self.logger.warning("fault tolerance: ignoring %s: %s", path, e)
            return
        if saved:
            self.fault_tol_client.load_state_dict(saved)
            self.logger.info("fault tolerance: timeouts loaded from %s", path)

    def _maybe_update_timeouts(self, is_final: bool) -> None:
        if not self.calculate_timeouts or self.caught_exception or not self.is_initialized:
            return
        chosen = choose_sections(
            self.was_checkpoint_loaded,
            self.num_tr_iters_total > self.MIN_TR_ITERS_FOR_STEP_TIMEOUT_UPDATE,
            self.last_checkpoint_iter > 0,
            self.uses_async_checkpointing,
        )
        out_of_section = is_final and {"setup", "step"} <= set(chosen)
        out_of_section = out_of_section and self.last_checkpoint_iter > 0
        if not chosen and not out_of_section:
            return
        client = self.fault_tol_client
        assert client is not None
        client.calculate_and_set_section_timeouts(
            selected_sections=chosen, calc_out_of_section=out_of_section
        )
        if _is_rank0() and self.timeouts_file_path is not None:
            self.timeouts_file_path.write_text(json.dumps(client.state_dict()))
            self.logger.info("fault tolerance: timeouts now %s", client.section_timeouts)

    # ---- ending ----------------------------------------------------------------------------

    def _apply_policy(self, trainer: Any, exception: BaseException) -> None:
        assert self.exc_handling_policy is not None and self.fault_tol_client is not None
        request = self.exc_handling_policy(exception)
        if not isinstance(request, WorkloadControlRequest):
            raise TypeError(
                f"exc_handling_policy must return a WorkloadControlRequest, not {request!r}"
            )
        self.fault_tol_client.send_workload_control_request(request)
        if request.action == WorkloadAction.ShutdownWorkload:
            self.logger.warning("fault tolerance: shutdown requested; writing the finished flag")
            self._write_flag(trainer, Ending.STOPPED)

    def _write_flag(self, trainer: Any, ending: Ending) -> None:
        path = finished_flag_path(self.provided_exp_dir, trainer.default_root_dir)
        write_finished_flag(path, ending, trainer)

    def _shutdown(self) -> None:
        while self._unwrap:
            self._unwrap.pop()()
        self._open.clear()
        client, self.fault_tol_client = self.fault_tol_client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.end_all_sections()
            client.shutdown_workload_monitoring()


def choose_sections(
    loaded: bool, enough_steps: bool, saved: bool, async_checkpointing: bool
) -> list[str]:
    """The sections whose timeouts NVRx recalculates, from what this fit has seen."""
    chosen = []
    if loaded:
        chosen.append("setup")
    if enough_steps:
        chosen.append("step")
    if saved and not async_checkpointing:  # an async save's section ends before its write does
        chosen.append("checkpointing")
    return chosen


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
