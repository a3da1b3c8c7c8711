"""examples/lightning_train.py under slurm/ftrun.sbatch on the local cluster: a preemption
(SIGTERM to the batch shell) saves through `PreemptionCallback`, the relaunched job resumes from
that step, and `FaultToleranceCallback` writes the finished flag the template reads, so the
chain stops once training is over (issue 18). Rank 1 is twice as slow in its training_step:
`StragglerDetectionCallback` on rank 0 names it, at the interval it gives the launchers."""

from __future__ import annotations

import json

import pytest
import torch
from ftrun_jobs import REPO, submit_chain, train_args

from support import wait_for

pytest.importorskip("pytorch_lightning", reason="needs ftrun[lightning]")

# One Slurm cluster per host: every Slurm test on the same xdist worker (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("slurm")


EXAMPLE = REPO / "examples" / "lightning_train.py"
LAUNCHER = ["--ft-prewarm-modules=torch,torch.distributed,pytorch_lightning"]
ONE_RUN_S = 150  # upper bounds: every worker imports Lightning (seconds on 2 cores)
TWO_RUNS_S = 300


@pytest.mark.slurm
def test_a_preempted_lightning_job_resumes_from_its_sigterm_checkpoint(slurm_cluster, tmp_path):
    job_dir = tmp_path / "job"
    ckpt = job_dir / "ckpt"
    train = train_args(job_dir, "--max-steps", "120", "--step-time", "0.05", "--local-every", "0",
                       "--slow-rank", "1:2", "--straggler-interval", "1")  # fmt: skip
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        [*LAUNCHER, str(EXAMPLE), *train],
        template_args=("--ft-relaunch=resubmit", "--ft-max-job-relaunches=2"),
    )
    wait_for((ckpt / "global" / "step=20.ckpt").exists, ONE_RUN_S, f"step 20\n{chain.describe()}")
    slurm_cluster.run("scancel", "--signal=TERM", "--batch", chain.first_job)
    history = chain.wait_stopped(TWO_RUNS_S)

    assert [r["decision"] for r in history] == ["relaunch", "stop"], chain.describe()
    first, second = history
    assert first["codes"] == [75, 75], chain.describe()  # preempted: relaunch me
    assert second["reason"].startswith("training finished"), second
    preempted = ckpt / "global" / "last-preempted.ckpt"
    saved = torch.load(preempted, weights_only=False)["global_step"]
    assert saved >= 20
    runs = (ckpt / "resume-rank0.txt").read_text().splitlines()
    assert runs == ["0 0 scratch", f"0 {saved} {preempted}"], runs
    assert json.loads((ckpt / "FINISHED").read_text())["ending"] == "max_steps"
    assert chain.state(second["job_id"]) == ("COMPLETED", "0:0")
    named = "Some GPUs have worse relative performance. Affected ranks: rank 1 on"
    assert named in chain.output(second["job_id"]), chain.describe()
    chain.assert_no_processes_left()
