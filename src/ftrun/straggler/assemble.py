"""From durations to a `Report`, in two pure steps shared by the agents and launcher-less runs.

1. `rank_record` (where the durations are: the rank's node agent, or the rank itself): one
   interval of one rank summarised per section, with its individual scores (they need only the
   rank's own history, kept where its durations arrive).
2. `assemble_columns` (one place for the whole job): relative scores across every rank, and
   the report, from each node's `Columns` (`assemble`: the same from rank records).

`encode_node`/`decode_node` are the per-node record the agents publish in the store: the
node's `Columns` as JSON, one value per node and interval, with the node's name in reports and
the report intervals its ranks asked for (see `adopt`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence

from ftrun import untrusted_json
from ftrun.straggler.report import Report
from ftrun.straggler.scores import History, Summary, summarise, weighted


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """One rank over one interval."""

    node: str
    cpu: Mapping[str, Summary]
    gpu: Mapping[str, Summary]
    cpu_individual: Mapping[str, float]
    gpu_individual: float | None


def rank_record(
    rank: int, node: str, durations: Mapping[tuple[str, bool], list[int]], history: History
) -> RankRecord:
    """Summaries and individual scores of `rank` from its (section, gpu) -> durations."""
    cpu: dict[str, Summary] = {}
    gpu: dict[str, Summary] = {}
    for (name, on_gpu), values in durations.items():
        if values:
            (gpu if on_gpu else cpu)[name] = summarise(values)

    def individual(summaries: dict[str, Summary], on_gpu: bool) -> dict[str, float]:
        scores = {n: history.score(rank, n, on_gpu, s.median) for n, s in summaries.items()}
        return {name: score for name, score in scores.items() if score is not None}

    cpu_ind, gpu_ind = individual(cpu, False), individual(gpu, True)
    gpu_score = weighted(gpu_ind, {n: gpu[n].total for n in gpu_ind}) if gpu_ind else None
    return RankRecord(node, cpu, gpu, cpu_ind, gpu_score)


@dataclasses.dataclass(frozen=True)
class Columns:
    """One node's interval, column-wise: what the store holds and what `assemble` reads.

    Lists are aligned with `ranks`; a rank without a section has None there. Columns keep a
    1,024-node report to list operations (no object per rank and section)."""

    node: str
    ranks: list[int]
    cpu: dict[str, list[list[float | None]]]
    """section -> [medians, totals]"""
    gpu: dict[str, list[list[float | None]]]
    cpu_individual: dict[str, list[float | None]]
    gpu_individual: list[float | None]
    label: str | None = None
    """The node's name in reports (its ranks' `node_name`), if not `node`."""
    asks: dict[str, float] = dataclasses.field(default_factory=dict)
    """rank (a string: JSON) -> the `report_time_interval` it gave `Detector.initialize`."""


def columns(
    node: str,
    ranks: Mapping[int, RankRecord],
    label: str | None = None,
    asks: Mapping[int, float] | None = None,
) -> Columns:
    order = sorted(ranks)
    records = [ranks[r] for r in order]

    def summaries(kind: str) -> dict[str, list[list[float | None]]]:
        names = sorted({n for rec in records for n in getattr(rec, kind)})
        found = {}
        for name in names:
            got = [getattr(rec, kind).get(name) for rec in records]
            found[name] = [[s and s.median for s in got], [s and s.total for s in got]]
        return found

    names = sorted({n for rec in records for n in rec.cpu_individual})
    individual = {n: [rec.cpu_individual.get(n) for rec in records] for n in names}
    gpu_ind = [rec.gpu_individual for rec in records]
    asked = {str(rank): value for rank, value in sorted((asks or {}).items())}
    cpu, gpu = summaries("cpu"), summaries("gpu")
    return Columns(node, order, cpu, gpu, individual, gpu_ind, label, asked)


def assemble(ranks: Mapping[int, RankRecord], seq: int = 0) -> Report:
    """The job's report from every rank's record of the same interval."""
    by_node: dict[str, dict[int, RankRecord]] = {}
    for rank, rec in ranks.items():
        by_node.setdefault(rec.node, {})[rank] = rec
    return assemble_columns([columns(node, mine) for node, mine in by_node.items()], seq)


def assemble_columns(nodes: Sequence[Columns], seq: int = 0) -> Report:
    """The job's report from every node's columns of the same interval."""
    started = time.perf_counter_ns()
    section_rel = {name: _relative(nodes, "cpu", name) for name in _names(nodes, "cpu")}
    gpu_num: dict[int, float] = {}
    gpu_den: dict[int, float] = {}
    for name in _names(nodes, "gpu"):
        scores = _relative(nodes, "gpu", name)
        for node in nodes:
            if name in node.gpu:
                for rank, total in zip(node.ranks, node.gpu[name][1], strict=True):
                    if total:
                        gpu_num[rank] = gpu_num.get(rank, 0.0) + scores[rank] * total
                        gpu_den[rank] = gpu_den.get(rank, 0.0) + total
    section_ind: dict[str, dict[int, float]] = {}
    gpu_ind: dict[int, float] = {}
    for node in nodes:
        for name, values in node.cpu_individual.items():
            mine = section_ind.setdefault(name, {})
            mine.update((r, v) for r, v in zip(node.ranks, values, strict=True) if v is not None)
        gpu_ind.update(
            (r, v) for r, v in zip(node.ranks, node.gpu_individual, strict=True)
            if v is not None and not math.isnan(v)
        )  # fmt: skip
    return Report(
        gpu_relative_perf_scores={r: gpu_num[r] / gpu_den[r] for r in gpu_num},
        section_relative_perf_scores=section_rel,
        gpu_individual_perf_scores=gpu_ind,
        section_individual_perf_scores=section_ind,
        rank_to_node={rank: node.label or node.node for node in nodes for rank in node.ranks},
        local_section_summaries={},
        local_kernel_summaries={},
        generate_report_elapsed_time=(time.perf_counter_ns() - started) * 1e-6,
        gather_on_rank0=True,
        rank=None,
        seq=seq,
    )


def _names(nodes: Sequence[Columns], kind: str) -> set[str]:
    return {name for node in nodes for name in getattr(node, kind)}


def _relative(nodes: Sequence[Columns], kind: str, name: str) -> dict[int, float]:
    """rank -> the fastest rank's median of section `name` / the rank's median."""
    ranks: list[int] = []
    medians: list[float] = []
    for node in nodes:
        section = getattr(node, kind).get(name)
        if section is not None:
            pairs = [(r, m) for r, m in zip(node.ranks, section[0], strict=True) if m]
            ranks += [r for r, _ in pairs]
            medians += [m for _, m in pairs]
    if not medians:
        return {}
    best = min(medians)
    return dict(zip(ranks, [best / m for m in medians], strict=True))


# ---- the node record in the store -------------------------------------------------------------


def encode_node(
    seq: int,
    node: str,
    ranks: Mapping[int, RankRecord],
    label: str | None = None,
    asks: Mapping[int, float] | None = None,
) -> bytes:
    body = {"seq": seq, **dataclasses.asdict(columns(node, ranks, label, asks))}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_node(raw: bytes) -> tuple[int, Columns]:
    """(seq, columns) of a node record; `ValueError` if malformed."""
    try:
        body = untrusted_json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        seq = int(body.pop("seq"))
        cols = Columns(**body)
        count = len(cols.ranks)
        for kind in (cols.cpu, cols.gpu):
            if any(len(col) != count for pair in kind.values() for col in pair):
                raise ValueError("columns of unequal length")
        _check_node_settings(cols)
        return seq, cols
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed straggler node record: {exc}") from None


def _check_node_settings(cols: Columns) -> None:
    if cols.label is not None and not isinstance(cols.label, str):
        raise ValueError("a label must be a string")
    if not isinstance(cols.asks, dict):
        raise ValueError("asks must be a map")
    for rank, value in cols.asks.items():
        int(rank)  # ValueError if not a rank
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError("an asked interval must be a positive number")


def asked_intervals(cols: Columns) -> dict[int, float]:
    """rank -> the report interval it asked (from a record `decode_node` accepted)."""
    return {int(rank): float(value) for rank, value in cols.asks.items()}
