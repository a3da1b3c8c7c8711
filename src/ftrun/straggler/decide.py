"""What the reporting agent does about a report: pure, from the report, the settings and the
round's size (`decide`); the service carries it out.

- `log`: findings go to the log and the events, nothing else.
- `stop`: the job ends (as a worker's ShutdownWorkload request: exit 3, do not relaunch).
- `exclude`: the node of the worst straggler leaves (as a worker's ExcludeThisNode request) if
  the job can go on without it: the round keeps at least the job's minimum of nodes, or a
  standby node takes its place; else the finding is only logged, saying why. At most one
  exclusion per cycle: the next cycle's ranks are measured afresh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ftrun.config.straggler import StragglerAction, StragglerConfig
from ftrun.straggler.report import Report


@dataclasses.dataclass(frozen=True)
class Finding:
    """One score below its threshold."""

    rank: int
    node: str
    kind: str
    """'gpu_relative', 'gpu_individual', 'section_relative' or 'section_individual'."""
    section: str | None
    score: float
    threshold: float

    def describe(self) -> str:
        what = self.kind.replace("_", " ") + (f" {self.section!r}" if self.section else "")
        return (
            f"rank {self.rank} on {self.node}: {what} score {self.score:.2f} < {self.threshold:g}"
        )


@dataclasses.dataclass(frozen=True)
class Decision:
    findings: tuple[Finding, ...]
    """Worst first."""
    action: str
    """'none' (no straggler), 'log', 'stop' or 'exclude'."""
    exclude: str | None = None
    """The node that leaves (action 'exclude')."""
    note: str = ""
    """Why an exclusion was not possible, for the log."""


def findings(
    report: Report, config: StragglerConfig, agents: Mapping[int, str] | None = None
) -> list[Finding]:
    """Every score of `report` below its threshold, worst first; each finding names the node
    as `agents` does (rank -> the agent's node, which the ranks' `node_name` may not be), else
    as the report does."""
    nodes = report.rank_to_node if agents is None else agents
    found: list[Finding] = []
    for kind, section, scores in report.score_kinds():
        limit = getattr(config, f"{kind}_threshold")
        found += [
            Finding(rank, nodes.get(rank, "<unk>"), kind, section, score, limit)
            for rank, score in scores.items()
            if score < limit
        ]
    found.sort(key=lambda f: (f.score, f.rank))
    return found


def decide(
    report: Report,
    config: StragglerConfig,
    nodes: Sequence[str],
    min_nodes: int,
    standby: int,
    excluded_this_cycle: bool,
    agents: Mapping[int, str] | None = None,
) -> Decision:
    found = tuple(findings(report, config, agents))
    if not found:
        return Decision((), "none")
    action = config.action
    if action is StragglerAction.STOP:
        return Decision(found, "stop")
    if action is StragglerAction.EXCLUDE:
        worst = found[0].node
        if excluded_this_cycle:
            return Decision(found, "log", note="a node was already excluded this cycle")
        if len(nodes) - 1 >= min_nodes or standby > 0:
            return Decision(found, "exclude", exclude=worst)
        note = (
            f"not excluding {worst}: {len(nodes)} node(s) in the round, the job needs "
            f"{min_nodes} and no standby node waits"
        )
        return Decision(found, "log", note=note)
    return Decision(found, "log")
