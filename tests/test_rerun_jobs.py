"""The re-run state machine across nodes, with real launchers (gloo, 2 nodes x 2 ranks plus a
standby where a node may have to move): a fault injected in one rank's result
(tests/workers/rerun_worker.py) is told apart as transient, a bad node's, or a correct but
unexpected result."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.errors import ExitCode
from launch import Job, start_job
from test_spares import killable, rounds, standby_nodes, wait_all

pytestmark = pytest.mark.process

WORKER = Path(__file__).resolve().parent / "workers" / "rerun_worker.py"
JOB = ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-conf=last_call_timeout=5"]
STEPS, FLIP_STEP = 30, 20
ONCE_STEP = 10  # a one-off flip before FLIP_STEP's, in the same job


def expected_w(steps: int, world: int = 4, lr: float = 0.01) -> float:
    """The weight after `steps` clean steps (the worker's model, in float64)."""
    w = 1.0
    for step in range(1, steps + 1):
        xs = [1.0 + 0.01 * step + 0.1 * r for r in range(world)]
        w -= lr * sum(2 * (w - 2) * x * x for x in xs) / world
    return w


def progress(job: Job, rank: int) -> list[tuple[int, int, float, float]]:
    rows = [line.split() for line in (job.ckpt_dir / f"progress-rank{rank}.txt").read_text()
            .splitlines()]  # fmt: skip
    return [(int(c), int(s), float(loss), float(w)) for c, s, loss, w, _ in rows]


def start(tmp_path: Path, mode: str, *extra: str) -> Job:
    job = start_job(tmp_path, 3, JOB, ["--flip", f"{mode}:{FLIP_STEP}", "--steps",
                                               str(STEPS), "--step-time", "0.03", *extra],
                    script=WORKER)  # fmt: skip
    job.wait_event("rendezvous_done", 2)
    return job


def flip_on(job: Job, fail_node: bool = False) -> tuple[str, int]:
    """Flip the second rank of an active node that does not host the store (`fail_node`: and
    mark that node's hardware bad); its name, rank. The workers wait at the flip step until
    this is decided (`flip-armed`), however slowly the test gets here."""
    first = rounds(job)[0]
    victim = killable(job, 0)
    name = next(n for n in first if n.endswith(f"-{victim.proc.pid}"))
    rank = 2 * first.index(name) + 1
    job.ckpt_dir.mkdir(parents=True, exist_ok=True)
    (job.ckpt_dir / "flip-rank").write_text(str(rank))
    if fail_node:
        (job.ckpt_dir / f"fail-{name}").write_text("")
    (job.ckpt_dir / "flip-armed").write_text("")
    return name, rank


def test_a_one_off_flip_is_transient_then_a_flip_on_one_node_excludes_it(tmp_path: Path):
    """A one-off flip first (step ONCE_STEP): the re-run in place clears it and nothing
    restarts; then a flip on a marked node (FLIP_STEP): the node is excluded and the standby
    carries on."""
    job = start(tmp_path, f"once:{ONCE_STEP},marked")
    name, rank = flip_on(job, fail_node=True)
    codes = wait_all(job, 120)
    victim = next(n for n in job.nodes if name.endswith(f"-{n.proc.pid}"))
    assert codes == {n.index: ExitCode.EXCLUDED if n is victim else 0 for n in job.nodes}
    verdicts = {v["diagnostic"]: v for v in job.events("rerun_verdict")}
    assert sorted(verdicts) == ["persistent_error", "transient_error"]
    # The one-off flip: its verdict in cycle 0, and cycle 0 went on past it on every rank.
    once = verdicts["transient_error"]
    assert (once["cycle"], once["rank"]) == (0, rank)
    for r in range(4):
        assert [s for c, s, *_ in progress(job, r) if c == 0][: FLIP_STEP - 1] == list(
            range(1, FLIP_STEP)
        )
    text = job.report()
    assert "Re-runs" in text and "transient_error (loss spike)" in text
    assert "training went on with the re-run's result" in text
    # The flip on the marked node.
    [suspect] = job.events("rerun_suspect")
    assert (suspect["node"], suspect["rank"]) == (name, rank)
    verdict = verdicts["persistent_error"]
    assert verdict["suspect_node"] == name
    spare = standby_nodes(job, 0).pop()
    assert rounds(job)[1] == [spare if n == name else n for n in rounds(job)[0]]
    for r in range(4):  # every rank ends where a run without the fault ends
        rows = progress(job, r)
        assert rows[-1][:2] == (1, STEPS)
        assert rows[-1][3] == pytest.approx(expected_w(STEPS), rel=1e-4)
    redone = next(row for row in progress(job, rank) if row[0] == 1)
    assert redone[1] == FLIP_STEP and redone[2] < 100  # the step re-run elsewhere, unflipped


def test_a_result_that_reproduces_everywhere_is_correct_and_fatal_stops_with_17(tmp_path: Path):
    job = start(tmp_path, "always", "--fatal")
    flip_on(job)
    codes = wait_all(job, 120)
    # Seen once under the suite's load (run 51): every agent exited 1; the nodes' ends say why.
    assert set(codes.values()) == {ExitCode.FAILED_ON_RESULT_VALIDATION}, "\n".join(
        n.text()[-2500:] for n in job.nodes
    )
    [verdict] = job.events("rerun_verdict")
    assert verdict["diagnostic"] == "correct_result"
    assert len(rounds(job)) == 2  # the re-run elsewhere, then the stop
