"""`FaultToleranceCallback`: a Lightning fit reports its progress to ft_launcher's rank monitor.

Only the fit stage is monitored, from `setup` to the end of training (`on_train_end`: see there
why not later). What the callback sends, through `RankMonitorClient`:

- a "step" section around every training batch (`on_train_batch_start` .. `on_train_batch_end`)
  and a heartbeat with `iteration=trainer.global_step` after it; heartbeats at the start and end
  of training and of validation, and after every validation batch;
- a heartbeat and a "checkpointing" section around every checkpoint save. Lightning has no hook
  after a save, so the section ends at the next hook the callback sees (the next batch,
  validation, the end of training): it covers the save and what follows it up to there.

Timeouts (`calculate_timeouts=True`): once this run has loaded a checkpoint, finished saving one
and sent a heartbeat after it (NVRx's rule: only then do the observed intervals include a load
and a save), and made 10 steps, every later save first asks the monitor to set the heartbeat
and "step" timeouts to safety factor x the longest observed interval, then stores the result in
the checkpoint (`checkpoint["ftrun_fault_tolerance"]`). A restart that loads that checkpoint
applies them before its first step, and its own calculations never go below them (the larger
value wins, timeout by timeout): one quick run does not tighten what a slower one needed. Only
rank 0 writes a Lightning checkpoint file, so every rank resumes with rank 0's values (per-rank
local checkpoints keep each rank's own).

The "checkpointing" section keeps its configured timeout (`--ft-rank-section-timeouts=
checkpointing:S`, none by default): the monitor times a section by when its marks arrive, and
the two marks of a save of a few milliseconds can arrive in one batch on a busy node, measured
as microseconds; times the safety factor, that was a hang verdict at the next save.

Finished flag (`autoresume=True`): rank 0 writes it in `on_fit_end` when `ending.classify` says
training is finished; never after an exception (`on_exception`) or an interrupting stop. See
`ftrun.lightning.ending` for the contract and the flag's location (`exp_dir`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ftrun.client_lib import RankMonitorClient
from ftrun.lightning._compat import Callback
from ftrun.lightning.ending import Ending, classify, finished_flag_path, write_finished_flag
from ftrun.lightning.simulated_fault import SimulatedFault, SimulatedFaultParams, current_cycle

log = logging.getLogger("ftrun.lightning")

STEP_SECTION = "step"
CHECKPOINT_SECTION = "checkpointing"
STATE_KEY = "ftrun_fault_tolerance"
"""The checkpoint key under which the calculated timeouts are kept."""


class _TimeoutReadiness:
    """When calculated timeouts would reflect a whole run: NVRx's rule, in one place."""

    MIN_STEPS = 10
    """Steps this run must have seen: a maximum over a handful of steps is not one."""

    def __init__(self) -> None:
        self.loaded = False
        self.steps = 0
        self.saving = False
        self.saves_done = 0
        self.heartbeats_after_save = 0

    def on_save_done(self) -> None:
        if self.saving:
            self.saving = False
            self.saves_done += 1

    def on_heartbeat(self) -> None:
        if self.saves_done and not self.saving:
            self.heartbeats_after_save += 1

    @property
    def ready(self) -> bool:
        return self.loaded and self.heartbeats_after_save > 0 and self.steps >= self.MIN_STEPS


class FaultToleranceCallback(Callback):
    """Heartbeats, sections, calculated timeouts and the finished flag for a Lightning fit.

    NVRx's arguments, in NVRx's order: `autoresume`: write the finished flag when training is
    over. `calculate_timeouts`: calculate timeouts and keep them with the checkpoints.
    `simulated_fault_params`: NVRx's timed fault (`SimulatedFaultParams` or its mapping).
    `exp_dir`: where the flag goes unless `$FTRUN_FINISHED_FLAG` says (default: the trainer's
    `default_root_dir`). `logger_name`: the logger of the callback's messages. ftrun's own,
    by keyword: `simulated_fault`: a step-exact `SimulatedFault` (or its mapping/string form), or
    a list of them, for tests and drills.
    Needs ft_launcher: `setup` raises `RankMonitorClientError` without it.
    """

    def __init__(
        self,
        autoresume: bool = True,
        calculate_timeouts: bool = True,
        simulated_fault_params: Any = None,
        exp_dir: str | Path | None = None,
        logger_name: str | None = "nemo_logger.FaultToleranceCallback",
        *,
        simulated_fault: Any = None,
    ) -> None:
        self.autoresume = bool(autoresume)
        self.calculate_timeouts = bool(calculate_timeouts)
        self.simulated_fault_params = SimulatedFaultParams.parse(simulated_fault_params)
        self.exp_dir = None if exp_dir is None else Path(exp_dir)
        self.logger = logging.getLogger(logger_name) if logger_name else log
        self.simulated_faults = SimulatedFault.parse_all(simulated_fault)
        self.client: RankMonitorClient | None = None
        self.ending: Ending | None = None
        self.flag_path: Path | None = None
        self._readiness = _TimeoutReadiness()
        self._in_checkpointing = False
        self._fitting = False
        self._cycle = 0
        self._loaded_timeouts: dict[str, Any] = {}

    @property
    def is_initialized(self) -> bool:
        return self.client is not None

    # ---- lifecycle -------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self._fitting:
            return
        self._fitting = True
        self._readiness = _TimeoutReadiness()
        self._loaded_timeouts = {}
        self.ending = None
        self._cycle = current_cycle()
        self.flag_path = finished_flag_path(self.exp_dir, trainer.default_root_dir)
        client = RankMonitorClient()
        client.init_workload_monitoring()
        self.client = client
        if self.simulated_fault_params is not None:
            seed = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{self._cycle}"
            self.simulated_fault_params.start(trainer.global_rank, trainer.world_size, seed)
        if trainer.is_global_zero:
            self.logger.info(
                "fault tolerance: monitoring rank 0 of %d; finished flag %s",
                trainer.world_size, self.flag_path if self.autoresume else "off",
            )  # fmt: skip

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._shutdown()
            self._fitting = False

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not self._fitting:
            return
        self.ending = Ending.FAILED
        self._fitting = False  # no teardown hook after an exception
        self._shutdown()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._fitting:
            return
        self._shutdown()  # a fit without training (no data) never reached on_train_end
        self.ending = classify(trainer)
        if trainer.is_global_zero:
            self.logger.info("fault tolerance: fit ended (%s) at step %d",
                     self.ending.value, trainer.global_step)  # fmt: skip
            if self.autoresume and self.ending.finished:
                assert self.flag_path is not None
                write_finished_flag(self.flag_path, self.ending, trainer)
                self.logger.info("fault tolerance: training finished; wrote %s", self.flag_path)

    # ---- progress --------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.client is not None:
            self._heartbeat(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Monitoring ends with training: Lightning's teardown, which runs next, resets every
        # signal handler it found at the start of the fit, and so unregisters the client's
        # faulthandler stack dump (SIGUSR2); a stack request after that would kill the rank.
        if self.client is not None:
            self._end_checkpointing()
            self._heartbeat(trainer.global_step)
            self._shutdown()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if self.client is not None:
            self._end_checkpointing()
            self.client.start_section(STEP_SECTION)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        client = self.client
        if client is None:
            return
        step = trainer.global_step
        for fault in self.simulated_faults:
            if fault.due(trainer.global_rank, step, self._cycle):
                fault.fire()  # inside the "step" section, where a real hang would be
        client.end_section(STEP_SECTION, iteration=step)
        self._heartbeat(step)
        self._readiness.steps += 1

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.client is not None:
            self._end_checkpointing()
            self._heartbeat(None)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kw: Any) -> None:
        if self.client is not None:
            self._heartbeat(None)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.client is not None:
            self._heartbeat(None)

    # ---- checkpoints -----------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        client = self.client
        if client is None:
            return
        self._end_checkpointing()  # two saves in a row: the first one ended here
        self._heartbeat(trainer.global_step)
        if self.calculate_timeouts and self._readiness.ready:
            self._calculate(trainer)
        if client.calculated_timeouts():  # NVRx's form, which NVRx's callback loads too
            checkpoint[STATE_KEY] = {"timeouts": client.state_dict()}
        client.start_section(CHECKPOINT_SECTION)
        self._in_checkpointing = True
        self._readiness.saving = True

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._readiness.loaded = True
        saved = checkpoint.get(STATE_KEY, {}).get("timeouts")
        if not saved or not self.calculate_timeouts or self.client is None:
            return
        self.client.load_state_dict(saved)
        self._loaded_timeouts = self.client.calculated_timeouts()
        if trainer.is_global_zero:
            self.logger.info("fault tolerance: timeouts from the checkpoint: %s", saved)

    # ---- internals -------------------------------------------------------------------------

    def _heartbeat(self, iteration: int | None) -> None:
        assert self.client is not None
        self.client.send_heartbeat(iteration=iteration)
        self._readiness.on_heartbeat()

    def _end_checkpointing(self) -> None:
        if self._in_checkpointing:
            assert self.client is not None
            self.client.end_section(CHECKPOINT_SECTION)
            self._in_checkpointing = False
            self._readiness.on_save_done()
            self._heartbeat(None)

    def _calculate(self, trainer: Any) -> None:
        client = self.client
        assert client is not None
        client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        client.calculate_and_set_section_timeouts(
            (STEP_SECTION,), calc_out_of_section=False, skip_if_not_ready=True
        )
        if self._loaded_timeouts:
            calculated = client.calculated_timeouts()
            merged = _larger(self._loaded_timeouts, calculated)
            if merged != calculated:
                client.load_state_dict(merged)
        if trainer.is_global_zero:
            calculated = client.calculated_timeouts()
            self.logger.info("fault tolerance: calculated timeouts: %s", calculated)

    def _shutdown(self) -> None:
        client, self.client = self.client, None
        self._in_checkpointing = False
        if client is not None:
            client.shutdown_workload_monitoring()


def _larger(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per timeout, the larger of two client state dicts (None, "off", is the largest)."""

    def pick(x: Any, y: Any) -> Any:
        if isinstance(x, dict) or isinstance(y, dict):
            x, y = x or {}, y or {}
            return {k: pick(x.get(k, y.get(k)), y.get(k, x.get(k))) for k in {*x, *y}}
        return None if x is None or y is None else max(x, y)

    return {k: pick(a.get(k, b.get(k)), b.get(k, a.get(k))) for k in {*a, *b}}
