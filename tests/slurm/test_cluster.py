"""Smoke test of the local Slurm cluster itself: a 2-node job runs one task per node."""

from __future__ import annotations

import pytest

# One Slurm cluster per host: every Slurm test on the same xdist worker (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("slurm")


@pytest.mark.slurm
def test_two_node_job_runs_one_task_per_node(slurm_cluster, tmp_path):
    out = tmp_path / "job-%j.out"
    # Single quotes inside --wrap: the task's shell, not the batch shell, must expand these
    # (the batch shell would print its own "0 n1" twice).
    job_id = slurm_cluster.submit(
        None,
        "--nodes=2",
        "--ntasks-per-node=1",
        f"--output={out}",
        "--wrap",
        "srun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME'",
    )
    info = slurm_cluster.wait_job_state(job_id, "COMPLETED", timeout=60)

    assert info["ExitCode"] == "0:0"
    assert info["NodeList"] == "n[1-2]"
    lines = (tmp_path / f"job-{job_id}.out").read_text().splitlines()
    assert sorted(lines) == ["0 n1", "1 n2"]
