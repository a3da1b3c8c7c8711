"""The live view's settings: the frozen `ObserveConfig` (`--ft-metrics-port`, `--ft-status-*`).

Torch-free: the launcher builds it before torch is imported.
"""

from __future__ import annotations

import dataclasses

DEFAULT_BIND = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """Where each agent serves its Prometheus metrics and the group-rank-0 agent its status page."""

    metrics_port: int | None = None
    """Every agent's Prometheus endpoint (None: off; 0: a free port, logged and written to
    cycle-info.json)."""
    status_port: int | None = None
    """The group-rank-0 agent's status page and `/status.json` (None: off; 0: a free port)."""
    bind: str = DEFAULT_BIND
    """The address both listen on: loopback unless the operator opens it on purpose."""
    publish_interval: float = 2.0
    """Seconds between a node's live progress records in the store, while the page is on."""

    @property
    def enabled(self) -> bool:
        return self.metrics_port is not None or self.status_port is not None
