"""The straggler records in the job's store, next to the other per-cycle, per-node keys.

`ftrun/<run id>/c<cycle>/straggler/<node>`: the node's latest interval record (`assemble`'s
JSON), overwritten every interval; `.../c<cycle>/straggler/report`: the reporting agent's
latest report. One `set` per node and interval; the reporting agent reads every node's record
with one `check` (halved on a miss) and one `multi_get`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from torch.distributed import Store

from ftrun.store.ops import existing_keys


class Board:
    def __init__(self, store: Store, run_id: str) -> None:
        self._store = store
        self._prefix = f"ftrun/{run_id}"

    def node_key(self, cycle: int, node: str) -> str:
        return f"{self._prefix}/c{cycle}/straggler/{node}"

    def report_key(self, cycle: int) -> str:
        return f"{self._prefix}/c{cycle}/straggler/report"

    def publish_node(self, cycle: int, node: str, record: bytes) -> None:
        self._store.set(self.node_key(cycle, node), record)

    def read_nodes(self, cycle: int, nodes: Sequence[str]) -> dict[str, bytes]:
        """node -> its latest record, for the nodes that published one this cycle."""
        keys = {self.node_key(cycle, node): node for node in nodes}
        present = existing_keys(self._store, list(keys))
        if not present:
            return {}
        values = self._store.multi_get(present)
        return {keys[key]: value for key, value in zip(present, values, strict=True)}

    def publish_report(self, cycle: int, report: dict[str, Any]) -> None:
        self._store.set(self.report_key(cycle), json.dumps(report, separators=(",", ":")))

    def read_report(self, cycle: int) -> dict[str, Any] | None:
        key = self.report_key(cycle)
        if not self._store.check([key]):
            return None
        return json.loads(self._store.get(key))
