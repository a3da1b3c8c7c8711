"""`StragglerDetectionCallback`: NVRx's Lightning callback over `ftrun.straggler`.

It times every call of the strategy's `training_step` (the rank's own forward: under DDP the
wait for slower peers happens later, in the gradient all-reduce, so it does not blur the
scores) with `Detector.wrap_callables`. Under ft_launcher the node agents compute the scores
on their own clock (`--ft-straggler-report-interval`; `report_time_interval` is used without
the launcher) and nothing on the training path waits for them; rank 0 reads each new report
at a step end and:

- logs NVRx's warning naming the straggling ranks and their nodes, and with
  `num_gpu_perf_scores_to_print > 0` the best and worst scores;
- logs min/median/max of each score kind to the trainer's loggers (`enable_ptl_logging`);
- with `stop_if_detected`, has every rank stop at the same step end (`vote.StopVote`), after a
  checkpoint in the `ModelCheckpoint`'s directory (`last-straggler-stop.ckpt`). The fit ends
  interrupted: no finished flag, so `slurm/` relaunches the job (launcher-side alternatives:
  `--ft-straggler-action=stop|exclude`).

"GPU" scores need CUDA. On CPU the timed section's scores stand in for them, with the same
thresholds (`gpu_relative_perf_threshold`, `gpu_individual_perf_threshold`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrun.lightning._compat import Callback
from ftrun.lightning.ending import request_stop
from ftrun.lightning.errors import LightningUsageError
from ftrun.lightning.vote import StopVote
from ftrun.straggler import CallableId, Detector, Report
from ftrun.straggler.report import format_scores

log = logging.getLogger("ftrun.lightning")

STOP_FILENAME = "last-straggler-stop.ckpt"
_SCORES = {"relative": "relative_perf_scores", "individual": "individual_perf_scores"}


class StragglerDetectionCallback(Callback):
    """Straggler reports in a Lightning fit, with NVRx's parameters (see the module)."""

    def __init__(
        self,
        report_time_interval: float,
        calc_relative_gpu_perf: bool,
        calc_individual_gpu_perf: bool,
        num_gpu_perf_scores_to_print: int,
        gpu_relative_perf_threshold: float,
        gpu_individual_perf_threshold: float,
        stop_if_detected: bool = False,
        enable_ptl_logging: bool = True,
        profiling_interval: int = 1,
    ) -> None:
        _check(_number(report_time_interval) and report_time_interval > 0,
               "report_time_interval must be a number > 0", report_time_interval)  # fmt: skip
        what = "calc_relative_gpu_perf or calc_individual_gpu_perf must be True"
        _check(calc_relative_gpu_perf or calc_individual_gpu_perf, what, False)
        _check(type(num_gpu_perf_scores_to_print) is int and num_gpu_perf_scores_to_print >= 0,
               "num_gpu_perf_scores_to_print must be an int >= 0",
               num_gpu_perf_scores_to_print)  # fmt: skip
        for name, value in (
            ("gpu_relative_perf_threshold", gpu_relative_perf_threshold),
            ("gpu_individual_perf_threshold", gpu_individual_perf_threshold),
        ):
            _check(_number(value) and 0 <= value <= 1, f"{name} must be in [0, 1]", value)
        _check(type(profiling_interval) is int and profiling_interval >= 1,
               "profiling_interval must be an int >= 1", profiling_interval)  # fmt: skip
        self.report_time_interval = float(report_time_interval)
        self.calc_relative_gpu_perf = calc_relative_gpu_perf
        self.calc_individual_gpu_perf = calc_individual_gpu_perf
        self.num_gpu_perf_scores_to_print = num_gpu_perf_scores_to_print
        self.gpu_relative_perf_threshold = gpu_relative_perf_threshold
        self.gpu_individual_perf_threshold = gpu_individual_perf_threshold
        self.stop_if_detected = stop_if_detected
        self.enable_ptl_logging = enable_ptl_logging
        self.profiling_interval = profiling_interval
        self.last_stragglers: dict[str, set[Any]] = {}
        """Rank 0: the stragglers of the last report ({"relative": ..., "individual": ...})."""
        self._initialized = False
        self._detected = False
        self._vote = StopVote(period=0.1)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self._initialized:
            return
        wanted = {"relative": self.calc_relative_gpu_perf,
                  "individual": self.calc_individual_gpu_perf}  # fmt: skip
        kinds = [kind for kind, on in wanted.items() if on]
        Detector.initialize(
            scores_to_compute=[_SCORES[k] for k in kinds],
            gather_on_rank0=True,
            profiling_interval=self.profiling_interval,
            report_time_interval=self.report_time_interval,
        )
        Detector.wrap_callables([CallableId(trainer.strategy, "training_step")])
        self._initialized = True

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._shutdown()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._vote.close(drain=False)
        self._shutdown()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._detected = False
        if self.stop_if_detected:
            self._vote.open()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._vote.close(drain=True)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._initialized:
            return
        report = Detector.generate_report_if_interval_elapsed()
        if report is not None:  # rank 0 only (gather_on_rank0)
            self._detected |= self._handle(report, pl_module)
        if self.stop_if_detected and self._vote.poll(trainer.global_step, self._detected):
            self._stop(trainer)

    def _handle(self, report: Report, pl_module: Any) -> bool:
        scores = self._scores(report)
        found = {kind: self._below(report, kind, values) for kind, values in scores.items()}
        self.last_stragglers = found
        if found.get("relative"):
            log.warning("STRAGGLER DETECTION WARNING: Some GPUs have worse relative performance. "
                        "Affected ranks: %s", _ids(found["relative"]))  # fmt: skip
        if found.get("individual"):
            log.warning("STRAGGLER DETECTION WARNING: Some GPUs performance dropped. "
                        "Affected ranks: %s", _ids(found["individual"]))  # fmt: skip
        count = self.num_gpu_perf_scores_to_print
        for kind, values in scores.items():
            if count and values:
                text = format_scores(values, report.rank_to_node, count)
                log.info("GPU %s performance:\n%s", kind, text)
            if self.enable_ptl_logging and values:
                _log_to_loggers(pl_module, f"gpu_{kind}_perf", values)
        return any(found.values())

    def _scores(self, report: Report) -> dict[str, Mapping[int, float]]:
        """Per kind asked for: the GPU scores, else (CPU) the timed section's."""
        found = {}
        for kind, gpu, sections in (
            ("relative", report.gpu_relative_perf_scores, report.section_relative_perf_scores),
            ("individual", report.gpu_individual_perf_scores,
             report.section_individual_perf_scores),
        ):  # fmt: skip
            if getattr(self, f"calc_{kind}_gpu_perf"):
                found[kind] = gpu or _step_section(sections)
        return found

    def _below(self, report: Report, kind: str, scores: Mapping[int, float]) -> set[Any]:
        threshold = getattr(self, f"gpu_{kind}_perf_threshold")
        nodes = report.rank_to_node
        return {(rank, nodes.get(rank, "<unk>")) for rank, s in scores.items() if s < threshold}

    def _stop(self, trainer: Any) -> None:
        log.error("stragglers detected: stopping the training (stop_if_detected)")
        callback = trainer.checkpoint_callback
        if callback is not None and callback.dirpath is not None:
            trainer.save_checkpoint(Path(callback.dirpath) / STOP_FILENAME)
        request_stop(trainer, "stragglers detected")

    def _shutdown(self) -> None:
        if self._initialized:
            Detector.shutdown()
            self._initialized = False


def _step_section(sections: Mapping[str, Mapping[int, float]]) -> Mapping[int, float]:
    """The wrapped training_step's scores among the report's sections."""
    for name, scores in sections.items():
        if name.endswith(".training_step"):
            return scores
    return {}


def _ids(found: set[Any]) -> str:
    return ", ".join(f"rank {rank} on {node}" for rank, node in sorted(found))


def _log_to_loggers(pl_module: Any, prefix: str, scores: Mapping[int, float]) -> None:
    values = list(scores.values())
    pl_module.log_dict(
        {f"{prefix}/min": min(values), f"{prefix}/median": statistics.median(values),
         f"{prefix}/max": max(values)},
        logger=True, batch_size=1, rank_zero_only=True,
    )  # fmt: skip


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, what: str, value: Any) -> None:
    if not ok:
        raise LightningUsageError(f"{what}: {value!r}")
