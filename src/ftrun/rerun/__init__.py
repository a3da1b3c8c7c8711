"""`ftrun.rerun`: Megatron-Core's re-run state machine, with the launcher re-running a rejected
step on another node (see `state_machine`). Switch by changing the import:

    from ftrun.rerun import (RerunDataIterator, RerunMode, get_rerun_state_machine,
                             initialize_rerun_state_machine)
"""

from __future__ import annotations

from typing import Any

from ftrun.rerun.data import RerunDataIterator
from ftrun.rerun.state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunDiagnostic,
    RerunMode,
    RerunState,
    RerunStateMachine,
    compare_floats,
)

__all__ = [
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "RerunDataIterator",
    "RerunDiagnostic",
    "RerunMode",
    "RerunState",
    "RerunStateMachine",
    "compare_floats",
    "destroy_rerun_state_machine",
    "get_rerun_state_machine",
    "initialize_rerun_state_machine",
]

_MACHINE: RerunStateMachine | None = None


def initialize_rerun_state_machine(**kwargs: Any) -> RerunStateMachine:
    """Create this process's state machine (once); its arguments are RerunStateMachine's."""
    global _MACHINE
    if _MACHINE is not None:
        raise RuntimeError("the rerun state machine is already initialized")
    _MACHINE = RerunStateMachine(**kwargs)
    return _MACHINE


def get_rerun_state_machine() -> RerunStateMachine:
    """This process's state machine (a disabled one if none was initialized, as Megatron-Core)."""
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = RerunStateMachine()
    return _MACHINE


def destroy_rerun_state_machine() -> None:
    global _MACHINE
    _MACHINE = None
