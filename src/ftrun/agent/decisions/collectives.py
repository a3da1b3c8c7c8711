"""Which rank never entered which collective: the analysis of PyTorch flight-recorder dumps.

Pure. Each rank's dump (torch's JSON format, `_dump_fr_trace_json`; parsed defensively, never
unpickled) is reduced to a `RankCollectives`: per process group, the last collective it
completed, the last it enqueued, and what the next one after the last completed is (op and
sizes). Across the ranks of a group:

- the last collective that every rank of the group completed is the lowest `completed`;
- the next one (`seq`) was entered by the ranks whose `enqueued` reached it;
- the ranks that never did are the suspects: the others wait for them.

Sequence numbers count a group's collectives in each rank's own order, which torch requires to
be the same on every rank; a rank that skipped a call is simply behind.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

_MAX_GROUPS = 256


@dataclasses.dataclass(frozen=True)
class GroupState:
    name: str
    ranks: tuple[int, ...]
    """The group's global ranks, when the dump says (empty: unknown)."""
    completed: int
    enqueued: int
    next_op: str = ""
    """The collective after `completed`, if this rank enqueued it: its op and input sizes."""
    next_sizes: str = ""


@dataclasses.dataclass(frozen=True)
class RankCollectives:
    rank: int
    groups: Mapping[str, GroupState]
    """By process-group id (creation order: the same on every rank)."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank,
                "groups": {k: dataclasses.asdict(g) for k, g in self.groups.items()}}  # fmt: skip

    @classmethod
    def from_json(cls, raw: Any) -> RankCollectives | None:
        try:
            groups = {str(k): GroupState(str(g["name"]), tuple(int(r) for r in g["ranks"]),
                                         int(g["completed"]), int(g["enqueued"]),
                                         str(g["next_op"]), str(g["next_sizes"]))
                      for k, g in dict(raw["groups"]).items()}  # fmt: skip
            return cls(int(raw["rank"]), groups)
        except (KeyError, TypeError, ValueError):
            return None


@dataclasses.dataclass(frozen=True)
class Stall:
    """A group whose next collective some ranks entered and others never did."""

    group: str
    last_completed: int
    """The last collective every rank of the group completed (sequence number)."""
    seq: int
    op: str
    sizes: str
    entered: tuple[int, ...]
    missing: tuple[int, ...]
    """Ranks that never entered collective `seq`: the likely cause."""
    no_dump: tuple[int, ...]
    """Ranks of the group whose dump did not come (dead, or not answering)."""

    def describe(self) -> str:
        if not self.missing and not self.no_dump:
            return (f"every rank entered {self.op} seq {self.seq} of group {self.group} (sizes "
                    f"{self.sizes}) and none completed it: the transport, not a rank")  # fmt: skip
        missing = _ranks(self.missing) or "(none dumped)"
        text = (
            f"rank(s) {missing} never entered {self.op} seq {self.seq} of group {self.group} "
            f"(sizes {self.sizes}); rank(s) {_ranks(self.entered)} did; every rank completed "
            f"seq {self.last_completed}"
        )
        if self.no_dump:
            text += f"; no dump from rank(s) {_ranks(self.no_dump)}"
        return text


def summarize(rank: int, raw: bytes) -> RankCollectives | None:
    """One rank's dump, reduced; None when it is not torch's JSON flight-recorder format."""
    try:
        dump = json.loads(raw)
        status = dict(dump["pg_status"])
        entries = list(dump.get("entries", []))
        configs = dict(dump.get("pg_config", {}))
    except (ValueError, TypeError, KeyError):
        return None
    groups: dict[str, GroupState] = {}
    for pg_id, state in list(status.items())[:_MAX_GROUPS]:
        try:
            completed = int(state["last_completed_collective"])
            enqueued = int(state["last_enqueued_collective"])
        except (KeyError, TypeError, ValueError):
            continue
        mine = [e for e in entries if isinstance(e, dict) and str(e.get("pg_id")) == str(pg_id)]
        # NCCL's recorder (torch 2.11) leaves last_completed at -1 and marks entries instead.
        done = [_seq(e) for e in mine if e.get("state") == "completed"]
        completed = max([completed, *done])
        enqueued = max([enqueued, *(_seq(e) for e in mine)])
        name, ranks = _identity(mine, configs)
        nxt = next((e for e in mine if e.get("collective_seq_id") == completed + 1), None)
        op = str(nxt.get("profiling_name", "")).split(":")[-1] if nxt else ""
        sizes = json.dumps(nxt.get("input_sizes")) if nxt else ""
        groups[str(pg_id)] = GroupState(name, ranks, completed, enqueued, op, sizes)
    return RankCollectives(rank, groups)


def _seq(entry: dict[str, Any]) -> int:
    try:
        return int(entry.get("collective_seq_id", -1))
    except (TypeError, ValueError):
        return -1


def _identity(
    entries: list[dict[str, Any]], configs: Mapping[str, Any]
) -> tuple[str, tuple[int, ...]]:
    """A group's name (its description, e.g. default_pg) and ranks, where the dump has them."""
    if not entries:
        return "", ()
    pg = entries[0].get("process_group") or ["", ""]
    name, desc = (str(pg[0]), str(pg[1])) if len(pg) == 2 else ("", "")
    config = configs.get(name) or (configs.get("") if desc == "default_pg" else None)
    try:
        ranks = tuple(int(r) for r in json.loads(config["ranks"])) if config else ()
    except (ValueError, TypeError, KeyError):
        ranks = ()
    return desc or name, ranks


def find_stalls(dumps: Iterable[RankCollectives], world: Iterable[int]) -> list[Stall]:
    """Every group where some ranks wait in a collective that others never entered."""
    by_rank = {d.rank: d for d in dumps}
    group_ids = sorted({g for d in by_rank.values() for g in d.groups}, key=_numeric)
    stalls = []
    for gid in group_ids:
        states = {r: d.groups[gid] for r, d in by_rank.items() if gid in d.groups}
        members = next((s.ranks for s in states.values() if s.ranks), ()) or tuple(world)
        present = [r for r in members if r in states]
        if not present:
            continue
        last = min(states[r].completed for r in present)
        entered = tuple(r for r in present if states[r].enqueued > last)
        if not entered:
            continue
        missing = tuple(r for r in present if states[r].enqueued <= last)
        first = states[entered[0]]
        stalls.append(Stall(first.name or gid, last, last + 1, first.next_op or "?",
                            first.next_sizes, entered, missing,
                            tuple(r for r in members if r not in states)))  # fmt: skip
    return stalls


def _numeric(key: str) -> tuple[int, str]:
    return (int(key), key) if key.isdigit() else (1 << 30, key)


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in ranks)
