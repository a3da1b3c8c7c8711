"""The straggler report: NVRx's `Report` and `StragglerId`, its JSON form and its log text.

Scores are ratios in (0, 1]-ish: reference time / this rank's median time. A relative score
compares a rank with the job's fastest rank in the same interval (0.5: twice as slow as the
best); an individual score compares a rank with its own recent past (0.5: twice as slow as it
used to be). "GPU" scores weigh the CUDA-timed sections by the time spent in them, as NVRx
weighs its kernels; "section" scores are per section, from CPU wall time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

from ftrun.config.straggler import DEFAULT_THRESHOLD


@dataclasses.dataclass(frozen=True)
class StragglerId:
    """A straggling rank and the node that hosts it."""

    rank: int
    node: str


@dataclasses.dataclass(frozen=True)
class Report:
    """Performance scores of one report interval (NVRx's field names).

    With `gather_on_rank0=True` the score maps hold every rank (on rank 0; other ranks get no
    report); with False, only the calling rank. `local_*_summaries` are the calling rank's own
    statistics where it computed them itself (no launcher), else empty.
    """

    gpu_relative_perf_scores: Mapping[int, float]
    section_relative_perf_scores: Mapping[str, Mapping[int, float]]
    gpu_individual_perf_scores: Mapping[int, float]
    section_individual_perf_scores: Mapping[str, Mapping[int, float]]
    rank_to_node: Mapping[int, str]
    local_section_summaries: Mapping[str, Any]
    local_kernel_summaries: Mapping[str, Any]
    generate_report_elapsed_time: float
    gather_on_rank0: bool
    rank: int | None
    seq: int = 0
    """The report interval's number in its cycle (ftrun's addition; 0 when computed locally)."""

    def identify_stragglers(
        self,
        gpu_rel_threshold: float = DEFAULT_THRESHOLD,
        section_rel_threshold: float = DEFAULT_THRESHOLD,
        gpu_indiv_threshold: float = DEFAULT_THRESHOLD,
        section_indiv_threshold: float = DEFAULT_THRESHOLD,
    ) -> dict[str, Any]:
        """NVRx's dict: 'straggler_gpus_relative', 'straggler_gpus_individual' (sets of
        `StragglerId`), 'straggler_sections_relative', 'straggler_sections_individual'
        (section -> set), for the scores below their threshold."""
        return {
            "straggler_gpus_relative": self._below(
                self.gpu_relative_perf_scores, gpu_rel_threshold
            ),
            "straggler_gpus_individual": self._below(
                self.gpu_individual_perf_scores, gpu_indiv_threshold
            ),
            "straggler_sections_relative": self._sections_below(
                self.section_relative_perf_scores, section_rel_threshold
            ),
            "straggler_sections_individual": self._sections_below(
                self.section_individual_perf_scores, section_indiv_threshold
            ),
        }

    def score_kinds(self) -> Iterator[tuple[str, str | None, Mapping[int, float]]]:
        """Every score map as (kind, section or None, rank -> score): 'gpu_relative',
        'gpu_individual', then 'section_relative' and 'section_individual' by section name."""
        yield "gpu_relative", None, self.gpu_relative_perf_scores
        yield "gpu_individual", None, self.gpu_individual_perf_scores
        for kind, sections in (
            ("section_relative", self.section_relative_perf_scores),
            ("section_individual", self.section_individual_perf_scores),
        ):
            for name, scores in sorted(sections.items()):
                yield kind, name, scores

    def _below(self, scores: Mapping[int, float], threshold: float) -> set[StragglerId]:
        node = self.rank_to_node
        return {StragglerId(r, node.get(r, "<unk>")) for r, s in scores.items() if s < threshold}

    def _sections_below(
        self, sections: Mapping[str, Mapping[int, float]], threshold: float
    ) -> dict[str, set[StragglerId]]:
        found = {name: self._below(scores, threshold) for name, scores in sections.items()}
        return {name: ids for name, ids in found.items() if ids}

    def for_rank(self, rank: int) -> Report:
        """The same report restricted to `rank` (NVRx's `gather_on_rank0=False` shape)."""

        def one(scores: Mapping[int, float]) -> dict[int, float]:
            return {rank: scores[rank]} if rank in scores else {}

        return dataclasses.replace(
            self,
            gpu_relative_perf_scores=one(self.gpu_relative_perf_scores),
            gpu_individual_perf_scores=one(self.gpu_individual_perf_scores),
            section_relative_perf_scores=_per_section(self.section_relative_perf_scores, one),
            section_individual_perf_scores=_per_section(self.section_individual_perf_scores, one),
            gather_on_rank0=False,
            rank=rank,
        )

    def to_json(self) -> dict[str, Any]:
        """The scores as JSON data (rank keys as strings); summaries are left out."""
        return {
            "seq": self.seq,
            "gpu_relative": _keyed(self.gpu_relative_perf_scores),
            "gpu_individual": _keyed(self.gpu_individual_perf_scores),
            "section_relative": {
                s: _keyed(v) for s, v in self.section_relative_perf_scores.items()
            },
            "section_individual": {
                s: _keyed(v) for s, v in self.section_individual_perf_scores.items()
            },
            "rank_to_node": _keyed(self.rank_to_node),
            "elapsed": self.generate_report_elapsed_time,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], rank: int | None = None) -> Report:
        """A report read back from `to_json` data (gathered: every rank's scores)."""
        return cls(
            gpu_relative_perf_scores=_ranked(data["gpu_relative"]),
            section_relative_perf_scores={
                s: _ranked(v) for s, v in data["section_relative"].items()
            },
            gpu_individual_perf_scores=_ranked(data["gpu_individual"]),
            section_individual_perf_scores={
                s: _ranked(v) for s, v in data["section_individual"].items()
            },
            rank_to_node=_ranked(data["rank_to_node"]),
            local_section_summaries={},
            local_kernel_summaries={},
            generate_report_elapsed_time=float(data.get("elapsed", 0.0)),
            gather_on_rank0=True,
            rank=rank,
            seq=int(data.get("seq", 0)),
        )


def _per_section(sections: Mapping[str, Mapping[int, float]], one: Any) -> dict[str, Any]:
    kept = {name: one(scores) for name, scores in sections.items()}
    return {name: scores for name, scores in kept.items() if scores}


def _keyed(scores: Mapping[int, Any]) -> dict[str, Any]:
    return {str(rank): value for rank, value in scores.items()}


def _ranked(scores: Mapping[str, Any]) -> dict[int, Any]:
    return {int(rank): value for rank, value in scores.items()}


# ---- the log text ------------------------------------------------------------------------------


def format_scores(
    scores: Mapping[int, float], rank_to_node: Mapping[int, str], count: int = 5
) -> str:
    """NVRx's listing: the worst and best `count` ranks, or every rank when there are few."""
    ordered = sorted(((s, r) for r, s in scores.items() if not math.isnan(s)), reverse=True)
    total = len(ordered)

    def lines(rows: list[tuple[float, int]]) -> str:
        return "".join(
            f"  Rank={r} Node={rank_to_node.get(r, '<unk>')} Score={s:.2f}\n" for s, r in rows
        )

    if total > 2 * count:
        worst = list(reversed(ordered[-count:]))
        return (
            f" Worst performing {count}/{total} ranks:\n{lines(worst)}"
            f" Best performing {count}/{total} ranks:\n{lines(ordered[:count])}"
        )
    return lines(list(reversed(ordered)))


def report_text(report: Report, count: int = 5) -> str:
    """The whole report as the launcher logs it: one block per score kind that has scores."""
    blocks = []
    for kind, section, scores in report.score_kinds():
        if scores:
            what = "GPU" if section is None else f"Section {section!r}"
            title = f"{what} {kind.partition('_')[2]} performance"
            blocks.append(f"{title}:\n{format_scores(scores, report.rank_to_node, count)}")
    return "".join(blocks)
