"""A closed barrier round as its closer publishes it: one compressed value every node reads once.

It holds the participants' descriptors in slot (group-rank) order with their arrival indices
(so each node finds itself), the standby nodes, the job's progress record (best iteration so
far, cycles in a row without progress), or an error every participant raises alike (a bad
infra rank). Descriptors of another version are published as `[version, node]` stubs so that
every participant refuses them with the same `DescriptorVersionError`, not only the closer.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Sequence

from ftrun import untrusted_json
from ftrun.errors import ProtocolError
from ftrun.rendezvous.errors import DescriptorVersionError, InfraRankError
from ftrun.rendezvous.ranks import NodeDescriptor, Round


def reported_iteration(raw: bytes) -> int | None:
    """A rank's progress report (the iteration it reached, as JSON); None if it is not one."""
    try:
        value = untrusted_json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclasses.dataclass(frozen=True)
class Progress:
    """The job's progress record, carried from round to round."""

    best_iteration: int | None = None
    """The highest iteration any rank reported in any earlier cycle (None: none ever)."""
    stalled_cycles: int = 0
    """Cycles in a row, up to the last one, whose ranks got no further than `best_iteration`."""

    def after(self, reports: Sequence[int | None]) -> Progress:
        """The record once the last cycle's nodes reported the highest iteration they reached.

        A job that never reported an iteration is not judged (it may not use the client); once
        one did, a cycle that does not pass the best so far counts as stalled.
        """
        reached = max((r for r in reports if r is not None), default=None)
        if reached is not None and (self.best_iteration is None or reached > self.best_iteration):
            return Progress(reached, 0)
        if self.best_iteration is None:
            return self
        return Progress(self.best_iteration, self.stalled_cycles + 1)


@dataclasses.dataclass(frozen=True)
class PublishedRound:
    rows: tuple[list[object], ...]
    """`NodeDescriptor.to_row` rows (or foreign-version stubs) in slot order."""
    indices: tuple[int, ...]
    """Each row's arrival index."""
    standby: tuple[str, ...] = ()
    progress: Progress = Progress()
    error: str | None = None
    """An `InfraRankError` message: the arrivals' infra ranks cannot order a round."""

    def encode(self) -> bytes:
        body = {
            "rows": list(self.rows),
            "indices": list(self.indices),
            "standby": list(self.standby),
            "best": self.progress.best_iteration,
            "stalled": self.progress.stalled_cycles,
            "error": self.error,
        }
        return zlib.compress(json.dumps(body).encode(), 1)

    @classmethod
    def decode(cls, raw: bytes) -> PublishedRound:
        """`encode`'s bytes back; `ProtocolError` for anything else in the store's value."""
        try:
            body = untrusted_json.loads(zlib.decompress(raw))
        except (zlib.error, ValueError) as exc:
            raise ProtocolError(f"the published round is unreadable ({exc})") from None
        if isinstance(body, list):  # a list of rows: a release before spares closed it
            raise DescriptorVersionError("the node that closed the round", "older than 3")
        if not (isinstance(body, dict)
                and all(type(body.get(k)) is list for k in ("rows", "indices", "standby"))
                and type(body.get("best")) in (int, type(None)) and type(body.get("stalled")) is int
                and type(body.get("error")) in (str, type(None))):  # fmt: skip
            raise ProtocolError("the published round is not a round record")
        return cls(rows=tuple(body["rows"]), indices=tuple(body["indices"]),
                   standby=tuple(body["standby"]), progress=Progress(body["best"], body["stalled"]),
                   error=body["error"])  # fmt: skip

    def nodes(self) -> tuple[NodeDescriptor, ...]:
        if self.error is not None:
            raise InfraRankError(self.error)
        return tuple(NodeDescriptor.from_rows(list(self.rows)))

    def round_for(self, cycle: int, index: int) -> Round | None:
        """Round `cycle` as the arrival `index` takes part in it; None if it stands by."""
        nodes = self.nodes()  # raises for every participant and standby alike
        if index not in self.indices:
            return None
        return Round(cycle, nodes, self.indices.index(index), standby=self.standby,
                     stalled_cycles=self.progress.stalled_cycles,
                     progress_known=self.progress.best_iteration is not None)  # fmt: skip
