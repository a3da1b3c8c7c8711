"""`LaunchConfig`: the one configuration tree of a launcher process.

`ftrun.ft_launcher` builds it (from argv, environment and YAML); the agent and its services only
read it. It lives outside both packages so that neither imports the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ftrun.config.agent import AgentConfig, HealthCheckConfig
from ftrun.config.monitor import RankMonitorConfig
from ftrun.config.observe import ObserveConfig
from ftrun.config.rendezvous import RendezvousConfig
from ftrun.config.straggler import StragglerConfig
from ftrun.identity import this_node


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything one `ft_launcher` process needs, validated; handed to `ftrun.agent.run_node`."""

    agent: AgentConfig
    rendezvous: RendezvousConfig
    monitor: RankMonitorConfig
    health: HealthCheckConfig
    log_level: str = "INFO"
    warnings: tuple[str, ...] = ()
    """Settings worth a warning (ignored flags, OMP_NUM_THREADS); `main` logs them."""
    straggler: StragglerConfig = dataclasses.field(default_factory=StragglerConfig)
    """The agents' straggler detection (`--ft-straggler-*`)."""
    observe: ObserveConfig = dataclasses.field(default_factory=ObserveConfig)
    """The live view: metrics and the status page (`--ft-metrics-port`, `--ft-status-*`)."""

    def this_node(self, environ: Mapping[str, str]) -> tuple[str, str]:
        """(advertised host, node name) of this launcher (`identity.this_node`)."""
        rdzv = self.rendezvous
        first = rdzv.endpoint.split(",")[0]  # etcd: the first member stands for the store
        return this_node(first, rdzv.local_addr, self.agent.node_name, environ)
