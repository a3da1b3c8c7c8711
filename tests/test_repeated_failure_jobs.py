"""The same failure every cycle stops the job on every job size (issue 37): real launchers on
127.0.0.1, one gloo rank per node, a script that raises the same IndexError at once in every
cycle, and no flag but `--max-restarts=10`. The default `--ft-max-same-failure=3` stops the job
with `ExitCode.REPEATED_FAILURE` on every launcher within 4 cycles, not after the 11 the budget
allows. (A node failing in its own slot with a standby waiting: test_attribution_jobs.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.errors import ExitCode
from launch import Job, start_job
from test_spares import rounds, wait_all

pytestmark = pytest.mark.process

# Every rank joins the gloo group, then fails the same way (the launcher appends --ckpt-dir).
SCRIPT = """\
import torch.distributed as dist

dist.init_process_group("gloo")
batches = [0]
print(batches[dist.get_rank() + 1])
"""


def same_error_every_cycle(tmp_path: Path, nodes: int) -> Job:
    script = tmp_path / "index_error.py"
    script.write_text(SCRIPT)
    return start_job(tmp_path, nodes, ["--max-restarts=10"], script=script)


def assert_stopped_for_the_repeat(job: Job) -> None:
    cycles = sorted(rounds(job))
    assert cycles[-1] <= 3, f"ran cycles {cycles}"  # within 4 cycles, not 11
    exits = job.events("exit")
    assert len(exits) == len(job.nodes)
    assert {e["code"] for e in exits} == {ExitCode.REPEATED_FAILURE}
    why = exits[0]["why"]
    assert "the same failure in 3 cycles on" in why and "in a row" in why, why
    assert "exception: IndexError at index_error.py:5 in <module>" in why, why
    assert {f["key"] for f in job.failures() if not f.get("secondary")} == {
        "exception: IndexError at index_error.py:5 in <module>"
    }


def test_a_one_node_job_failing_the_same_way_every_cycle_stops_not_relaunched(tmp_path: Path):
    job = same_error_every_cycle(tmp_path, 1)
    assert wait_all(job, 120) == {0: ExitCode.REPEATED_FAILURE}
    assert_stopped_for_the_repeat(job)


def test_a_two_node_job_failing_the_same_way_every_cycle_stops_on_both(tmp_path: Path):
    job = same_error_every_cycle(tmp_path, 2)
    assert wait_all(job, 120) == {0: ExitCode.REPEATED_FAILURE, 1: ExitCode.REPEATED_FAILURE}
    assert_stopped_for_the_repeat(job)
