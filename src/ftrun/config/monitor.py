"""The RankMonitorServer's configuration and the environment contract with workers."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping
from types import MappingProxyType

# The launcher's own variables for workers are `ftrun.environment.Env`'s; torchrun's:
ENV_RANK = "RANK"
"""The worker's global rank, as torchrun sets it."""


@dataclasses.dataclass(frozen=True)
class RankMonitorConfig:
    """Timeouts in seconds (`None` = that check is off) and stack-capture settings."""

    initial_rank_heartbeat_timeout: float | None = 3600.0
    rank_heartbeat_timeout: float | None = 2700.0
    rank_section_timeouts: Mapping[str, float | None] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    rank_out_of_section_timeout: float | None = None
    safety_factor: float = 5.0
    calculated_timeout_floor: float = 5.0
    """The shortest timeout a rank may calculate or load from a saved state (NVRx's
    `workload_check_interval`: NVRx looks every 5 s, so it never judges sooner). Timeouts the
    launcher is given explicitly are judged to the millisecond, below it too."""
    num_warmup_iterations: int = 5
    """The first N `step` sections of each rank's start are judged with the `warmup` section
    timeout, where one is configured (NVRx's default and meaning); a client's
    `init_workload_monitoring(num_warmup_iters=)` overrides it for its rank."""
    stack_signal: signal.Signals = signal.SIGUSR2
    stack_capture_timeout: float = 1.0
    """How long to wait for a hung rank's stack dump before reporting without it."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "rank_section_timeouts", MappingProxyType(dict(self.rank_section_timeouts))
        )
