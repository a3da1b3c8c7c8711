"""The re-run state machine: tell a transient fault, a bad GPU and a genuine but unexpected
result apart by re-running the step, in place and then on another node.

Megatron-Core's names (`megatron/core/rerun_state_machine.py`), so a training loop written for
it switches by an import; ftrun's launcher runs the part across nodes. In one step:

    while rsm.should_run_forward_backward(data_iterator):
        optimizer.zero_grad()
        loss = loss_fn(model(next(data_iterator)))
        rsm.validate_result(loss, torch.isnan, "loss is NaN", tolerance=0.0, fatal=True)
        loss.backward()
    checkpoint, exit_now, code = rsm.should_checkpoint_and_exit()
    if checkpoint: save({... "rerun": rsm.state_dict()})   # ftrun.checkpointing's local tier
    if exit_now: sys.exit(code)
    optimizer.step()

A rejected result re-runs the step here, on the same GPU, from the same state (RNG states and
`state_save_func`'s) and the same batches (`RerunDataIterator`):
- a different result: a **transient** error; the step goes on with the re-run's result;
- the same result: the step must be re-run elsewhere. Every rank checkpoints and exits 16
  (`EXIT_CODE_RESUME_TO_DISAMBIGUATE`); under ft_launcher the suspect rank's node steps aside and
  a standby node takes its slot. The re-run from the checkpoint, on another node, decides:
  a different result is a **persistent** error of the first node (it is excluded, training goes
  on); the same result is **correct** (if unexpected): training goes on, or, when `fatal`, every
  rank exits 17 (`EXIT_CODE_FAILED_ON_RESULT_VALIDATION`) and the job stops.

Flags are all-reduced (any rank's request is every rank's), so every rank follows the same
path. Each verdict is written for the launcher (`verdicts.tell`): an event, a line of `ftrun
report`. Caveat, as in Megatron-Core: a step's control flow must be the same when re-run (the
same `validate_result` calls in the same order); its numbers need not be.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from typing import Any

from ftrun.rerun import context, rng, verdicts
from ftrun.rerun.context import DataIteratorArg, compare_floats
from ftrun.rerun.data import RerunDataIterator
from ftrun.rerun.stats import DeterminismStats

log = logging.getLogger("ftrun.rerun")

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
"""Exit code: resume the job from the checkpoint just saved, on other GPUs, to decide."""
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
"""Exit code: a result failed validation and the diagnosis is complete: stop the job."""


class RerunMode(str, enum.Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunDiagnostic(str, enum.Enum):
    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunState(enum.Enum):
    """NOT_RUNNING_YET -> INITIAL_RUN -> (rejected) RERUNNING_IN_PLACE -> (reproduced)
    WILL_RERUN_FROM_CHECKPOINT -> [exit 16, resume elsewhere] -> RERUNNING_FROM_CHECKPOINT ->
    NOT_RUNNING_YET, or (rescheduled on the suspect GPU) RERUNNING_AGAIN_FROM_CHECKPOINT."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


_S = RerunState
TRANSITIONS: dict[RerunState, frozenset[RerunState]] = {
    _S.NOT_RUNNING_YET: frozenset({_S.INITIAL_RUN}),
    _S.INITIAL_RUN: frozenset({_S.NOT_RUNNING_YET, _S.RERUNNING_IN_PLACE}),
    _S.RERUNNING_IN_PLACE: frozenset({_S.NOT_RUNNING_YET, _S.WILL_RERUN_FROM_CHECKPOINT}),
    _S.WILL_RERUN_FROM_CHECKPOINT: frozenset({_S.RERUNNING_FROM_CHECKPOINT}),
    _S.RERUNNING_FROM_CHECKPOINT: frozenset(
        {_S.NOT_RUNNING_YET, _S.RERUNNING_AGAIN_FROM_CHECKPOINT}
    ),
    _S.RERUNNING_AGAIN_FROM_CHECKPOINT: frozenset({_S.RERUNNING_FROM_CHECKPOINT}),
}


class RerunStateMachine:
    """One per process (`initialize_rerun_state_machine`, `get_rerun_state_machine`)."""

    def __init__(
        self,
        state_save_func: Callable[[], Any] | None = None,
        state_restore_func: Callable[[Any], None] | None = None,
        mode: RerunMode | str = RerunMode.DISABLED,
        error_injector: Any = None,
        result_rejected_tracker_filename: str | None = None,
        determinism_every: int = 1,
    ) -> None:
        """`determinism_every` (ftrun's): in REPORT_DETERMINISM_STATS mode, re-run every Nth
        step (Megatron-Core re-runs every step)."""
        if error_injector is not None:
            log.warning("RerunStateMachine: error_injector is not supported by ftrun and is "
                        "ignored; inject faults in the result instead")  # fmt: skip
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.first_iteration_complete = False
        self.state_save_func, self.state_restore_func = state_save_func, state_restore_func
        self.tracker = result_rejected_tracker_filename
        self.determinism_every = max(1, int(determinism_every))
        self.stats = DeterminismStats()
        self._reset_step_flags()
        self.failed_call: tuple[str, int] | None = None
        self.initial_result: Any = None
        self.suspicious_node = ""
        self.suspicious_device = -1
        self.saved_state: Any = None
        self.data_iterator_checkpoints: list[Any] | None = None
        self.diagnostics: list[tuple[int, RerunDiagnostic, str]] = []
        """(iteration, diagnostic, message) of every verdict this process reached."""
        self._calls: dict[str, int] = {}
        self._saved_results: dict[tuple[str, int], Any] = {}

    # ---- the loop's three calls ----------------------------------------------------------

    def should_run_forward_backward(self, data_iterator: DataIteratorArg) -> bool:
        """Whether to (re)run the step's forward-backward pass now."""
        self._calls = {}
        return _STEP[self.state](self, context.iterators(data_iterator))

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """(checkpoint now, exit now, the exit code): after the step, before optimizer.step()."""
        self.first_iteration_complete = True
        if self.mode is not RerunMode.VALIDATE_RESULTS:
            return False, False, 0
        if self.state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
            log.warning("saving a checkpoint and exiting %d: the step is re-run elsewhere",
                        EXIT_CODE_RESUME_TO_DISAMBIGUATE)  # fmt: skip
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state is RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state is RerunState.RERUNNING_FROM_CHECKPOINT:  # correct, and fatal
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        return False, False, 0

    def validate_result(
        self,
        result: Any,
        rejection_func: Callable[[Any], Any],
        message: str = "unexpected result",
        comparison_func: Callable[[Any, Any], float] | None = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Check `result`; a rejection re-runs the step (see the module's docstring)."""
        if self.mode is RerunMode.DISABLED:
            if bool(rejection_func(result)):
                text = f"rank {context.rank()}, iteration {self.current_iteration}: unexpected " \
                       f"result {context.text(result)} ({message})"  # fmt: skip
                if fatal:
                    raise RuntimeError(text)
                log.warning("%s", text)
            return
        if self.state is RerunState.NOT_RUNNING_YET:
            raise RuntimeError("validate_result() outside should_run_forward_backward()'s loop")
        call = (message, self._calls.setdefault(message, 0))
        self._calls[message] += 1
        compare = comparison_func or compare_floats
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._record_determinism(call, result, compare)
        elif self.state is RerunState.INITIAL_RUN:
            self._check_initial(call, result, rejection_func, message)
        elif call == self.failed_call:
            self._compare(result, compare(self.initial_result, result) > tolerance, message,
                          fatal)  # fmt: skip

    # ---- state to save with a checkpoint ----------------------------------------------------

    def state_dict(
        self, data_iterator: DataIteratorArg = None, ckpt_format: str | None = None
    ) -> dict[str, Any]:
        """What a re-run elsewhere needs: the machine's state, the step's batches, the RNG and
        `state_save_func`'s state from before the step. Storable without pickle, so one form
        serves every checkpoint format: Megatron-Core's `ckpt_format` is accepted and not
        needed (its sharded-object wrapping is the caller's, if it wants one)."""
        # The step's batches only when the step is to be re-run from this checkpoint.
        will_rerun = self.state is RerunState.WILL_RERUN_FROM_CHECKPOINT
        its = context.iterators(data_iterator) if will_rerun else []
        return {
            "mode": self.mode.value,
            "state": self.state.name,
            "current_iteration": self.current_iteration,
            "failed_call": list(self.failed_call) if self.failed_call else None,
            "initial_result": context.plain(self.initial_result),
            "suspicious_node": self.suspicious_node,
            "suspicious_device": self.suspicious_device,
            "saved_state": self.saved_state,
            "data_iterators": [d.state_dict() for d in its] or None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mode = RerunMode(state["mode"])
        self.state = RerunState[state["state"]]
        self.current_iteration = int(state["current_iteration"])
        call = state.get("failed_call")
        self.failed_call = (str(call[0]), int(call[1])) if call else None
        self.initial_result = state.get("initial_result")
        self.suspicious_node = str(state.get("suspicious_node", ""))
        self.suspicious_device = int(state.get("suspicious_device", -1))
        self.saved_state = state.get("saved_state")
        self.data_iterator_checkpoints = state.get("data_iterators")

    # ---- one method per state (should_run_forward_backward) ---------------------------------

    def _begin_step(self, iterators: list[RerunDataIterator]) -> bool:
        if self.mode is not RerunMode.DISABLED:
            self.saved_state = rng.capture(self.state_save_func)
            for it in iterators:
                it.advance()
        self._reset_step_flags()
        self.current_iteration += 1
        self._move(RerunState.INITIAL_RUN)
        return True

    def _after_initial(self, iterators: list[RerunDataIterator]) -> bool:
        if self.mode is RerunMode.DISABLED or not context.any_rank(self.rerun_requested):
            self._move(RerunState.NOT_RUNNING_YET)
            return False
        self._move(RerunState.RERUNNING_IN_PLACE)
        self._replay(iterators)
        return True

    def _after_rerun_in_place(self, iterators: list[RerunDataIterator]) -> bool:
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._move(RerunState.NOT_RUNNING_YET)
            self.stats.maybe_report(self.current_iteration)
            return False
        checkpoint = context.any_rank(self.checkpoint_requested)
        self._move(RerunState.WILL_RERUN_FROM_CHECKPOINT if checkpoint
                   else RerunState.NOT_RUNNING_YET)  # fmt: skip
        if checkpoint:
            self._replay(iterators)  # the checkpoint holds the state from before the step
        return False

    def _resume_elsewhere(self, iterators: list[RerunDataIterator]) -> bool:
        self._move(RerunState.RERUNNING_FROM_CHECKPOINT)
        if self.data_iterator_checkpoints:
            for it, saved in zip(iterators, self.data_iterator_checkpoints, strict=False):
                it.load_state_dict(saved)
            self.data_iterator_checkpoints = None
        rng.restore(self.saved_state, self.state_restore_func)
        return True

    def _after_rerun_elsewhere(self, iterators: list[RerunDataIterator]) -> bool:
        again = context.any_rank(self.restart_again_requested)
        stop = context.any_rank(self.exit_requested)
        if again:
            self._move(RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT)
        elif not stop:
            self._move(RerunState.NOT_RUNNING_YET)
        return False

    def _not_again(self, iterators: list[RerunDataIterator]) -> bool:
        raise RuntimeError("the step must be re-run on another GPU: exit with the code "
                           "should_checkpoint_and_exit() gives")  # fmt: skip

    # ---- helpers -------------------------------------------------------------------------

    def _check_initial(self, call: tuple[str, int], result: Any, reject: Callable[[Any], Any],
                       message: str) -> None:  # fmt: skip
        if self.rerun_requested or not self.first_iteration_complete:
            return  # one rejection per step; never the first step (nothing to resume from)
        if bool(reject(result)):
            self.failed_call, self.initial_result = call, context.plain(result)
            self.rerun_requested = True
            self._track("rejected", result, message)
            log.error("rank %d, iteration %d: unexpected result %s (%s): re-running the step "
                      "in place", context.rank(), self.current_iteration, context.text(result),
                      message)  # fmt: skip

    def _compare(self, result: Any, differs: bool, message: str, fatal: bool) -> None:
        in_place = self.state is RerunState.RERUNNING_IN_PLACE
        if in_place and differs:
            self._verdict(RerunDiagnostic.TRANSIENT_ERROR, result, message, fatal)
        elif in_place:
            self.checkpoint_requested = True
            self.suspicious_node, self.suspicious_device = context.node(), context.device()
            self._track("reproduced in place", result, message)
            verdicts.tell(self._fact("suspect", message, result, fatal))
        elif (context.node(), context.device()) == (self.suspicious_node, self.suspicious_device):
            log.error("re-run scheduled on the suspect GPU again (%s, device %d): resume again "
                      "elsewhere", self.suspicious_node, self.suspicious_device)  # fmt: skip
            self.restart_again_requested = True
            verdicts.tell(self._fact("suspect", message, result, fatal))  # step aside again
        elif differs:
            self._verdict(RerunDiagnostic.PERSISTENT_ERROR, result, message, fatal)
        else:
            self._verdict(RerunDiagnostic.CORRECT_RESULT, result, message, fatal)
            self.exit_requested = fatal

    def _verdict(self, diagnostic: RerunDiagnostic, result: Any, message: str, fatal: bool) -> None:
        self.diagnostics.append((self.current_iteration, diagnostic, message))
        self._track(diagnostic.value, result, message)
        log.warning("rank %d, iteration %d: %s (%s): first %s, re-run %s", context.rank(),
                    self.current_iteration, diagnostic.value, message,
                    context.text(self.initial_result), context.text(result))  # fmt: skip
        fact = self._fact("verdict", message, result, fatal)
        verdicts.tell(dataclasses.replace(fact, diagnostic=diagnostic.value))

    def _fact(self, kind: str, message: str, result: Any, fatal: bool) -> verdicts.RerunFact:
        return verdicts.RerunFact(
            kind, context.rank(), context.node(), self.current_iteration, message,
            suspect_node=self.suspicious_node, initial=context.text(self.initial_result),
            rerun=context.text(result), fatal=fatal,
        )  # fmt: skip

    def _record_determinism(self, call: tuple[str, int], result: Any, compare: Any) -> None:
        if self.state is RerunState.INITIAL_RUN:
            if self.current_iteration % self.determinism_every == 0:
                self.rerun_requested = True
                self._saved_results[call] = context.plain(result)
        elif call in self._saved_results:
            self.stats.record(call[0], compare(self._saved_results.pop(call), result))

    def _replay(self, iterators: list[RerunDataIterator]) -> None:
        rng.restore(self.saved_state, self.state_restore_func)
        for it in iterators:
            it.rewind()

    def _reset_step_flags(self) -> None:
        self.rerun_requested = self.checkpoint_requested = False
        self.restart_again_requested = self.exit_requested = False

    def _move(self, state: RerunState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"rerun state {self.state.name} -> {state.name} is not allowed")
        self.state = state

    def _track(self, status: str, result: Any, message: str) -> None:
        if self.tracker:
            with open(self.tracker, "a") as f:
                f.write(f"{self.current_iteration}\t{context.rank()}\t{context.node()}\t{status}\t"
                        f"{context.text(result)}\t{message}\n")  # fmt: skip


_STEP: dict[RerunState, Callable[[RerunStateMachine, list[RerunDataIterator]], bool]] = {
    _S.NOT_RUNNING_YET: RerunStateMachine._begin_step,
    _S.INITIAL_RUN: RerunStateMachine._after_initial,
    _S.RERUNNING_IN_PLACE: RerunStateMachine._after_rerun_in_place,
    _S.WILL_RERUN_FROM_CHECKPOINT: RerunStateMachine._resume_elsewhere,
    _S.RERUNNING_FROM_CHECKPOINT: RerunStateMachine._after_rerun_elsewhere,
    _S.RERUNNING_AGAIN_FROM_CHECKPOINT: RerunStateMachine._not_again,
}
