"""slurm/ftrun.sbatch on the local cluster: in-job restarts, job relaunches, preemption, stops.

Each test runs a 2-node job (one ft_launcher per node, one worker each) in its own tmp dir with
its own rendezvous port, waits on the job dir's history and Slurm's job states with deadlines,
and checks that no process of any of its jobs is left on any node.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import psutil
import pytest
from ftrun_jobs import (
    EXAMPLE,
    TRAIN_FIRST_RUN_FAULTS,
    Chain,
    free_port,
    job_env,
    submit_chain,
    train_args,
)

from support import wait_for

# One Slurm cluster per host: every Slurm test on the same xdist worker (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("slurm")

# Upper bounds, not expectations: one run takes ~10-25 s here (2 cores shared with other test
# sessions; every worker imports torch), a requeued job waits ~11 s more (cred_expire=10).
ONE_RUN_S = 150
TWO_RUNS_S = 240
# Quick launchers for the decision paths: no training, no spare workers importing torch.
QUICK = ["--ft-prewarm-modules=none", "--max-restarts=0", "--no-python"]
# The health check fails on n2 only: its launcher reports the node unhealthy and exits 3.
UNHEALTHY_N2 = '--ft-node-health-check-cmd=test "$SLURMD_NODENAME" != n2'


def split_at_resume(steps: list[int]) -> tuple[list[int], list[int]]:
    """Steps of the first run and of the run after it: the second starts where steps go back."""
    for i in range(1, len(steps)):
        if steps[i] <= steps[i - 1]:
            return steps[:i], steps[i:]
    return steps, []


def steps_of(chain: Chain, rank: int = 0) -> list[int]:
    return [step for _cycle, step in chain.progress(rank)]


@pytest.mark.slurm
def test_crash_restarts_in_job_and_finishes_in_one_job(slurm_cluster, tmp_path: Path):
    job_dir = tmp_path / "job"
    train = train_args(job_dir, "--steps", "8", "--save-every", "3", "--crash", "0:1:5")
    page = free_port()
    live_view = [f"--ft-status-port={page}", "--ft-metrics-port=0"]
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        ["--max-restarts=1", *live_view, str(EXAMPLE), *train],
        template_args=("--ft-max-job-relaunches=2",),
    )

    history = chain.wait_stopped(ONE_RUN_S)

    assert [r["decision"] for r in history] == ["stop"], chain.describe()
    assert history[0]["reason"].startswith("training finished"), chain.describe()
    assert history[0]["codes"] == [0, 0]
    assert chain.job_ids() == [chain.first_job]  # exactly one job ran
    assert chain.state(chain.first_job) == ("COMPLETED", "0:0")
    info = slurm_cluster.job_info(chain.first_job)
    assert info["Restarts"] == "0"
    # Rank 1 crashed in cycle 0; cycle 1 of the same job resumed from step 3 and finished.
    progress = chain.progress(0)
    assert {cycle for cycle, _ in progress} == {0, 1}
    assert [step for cycle, step in progress if cycle == 1] == [4, 5, 6, 7, 8]
    assert (job_dir / "ckpt" / "FINISHED").exists()
    # The recipe says where the live view is; the launchers served it.
    output = chain.output(chain.first_job)
    assert f":{page}/ and /status.json, served by group rank 0" in output, output
    assert "metrics: a free port on each node" in output
    assert f"ftrun.agent: status page: http://127.0.0.1:{page}/" in output, output
    chain.assert_no_processes_left()


@pytest.mark.slurm
def test_spent_restart_budget_relaunches_job_from_checkpoint(slurm_cluster, tmp_path: Path):
    job_dir = tmp_path / "job"
    # --max-restarts=0: the crash (first run only) ends the job's first allocation.
    train = train_args(job_dir, "--steps", "8", "--save-every", "3", "--crash", "0:1:6")
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        ["--max-restarts=0", str(TRAIN_FIRST_RUN_FAULTS), *train],
        template_args=("--ft-max-job-relaunches=2",),
    )

    history = chain.wait_stopped(TWO_RUNS_S)

    assert [r["decision"] for r in history] == ["relaunch", "stop"], chain.describe()
    first, second = history
    assert first["codes"] == [1, 1] and first["exit_code"] == 1
    assert first["relaunches"] == 1 and second["relaunches"] == 1  # the count, in the job dir
    assert second["job_id"] == first["next_job_id"] != first["job_id"]
    assert second["reason"].startswith("training finished")
    assert chain.state(first["job_id"]) == ("FAILED", "1:0")
    assert chain.state(second["job_id"]) == ("COMPLETED", "0:0")
    # The relaunch resumed right after the last periodic checkpoint, never before it.
    before, after = split_at_resume(steps_of(chain))
    assert before == list(range(1, len(before) + 1)) and len(before) >= 3, before
    last_checkpoint = max(step for step in before if step % 3 == 0)
    assert after == list(range(last_checkpoint + 1, 9)), (before, after)
    chain.assert_no_processes_left()


@pytest.mark.slurm
@pytest.mark.parametrize("mode", ["resubmit", "requeue"])
def test_preempted_job_resumes_from_its_sigterm_checkpoint(slurm_cluster, tmp_path, mode):
    job_dir = tmp_path / "job"
    # No periodic checkpoint (--save-every 1000): a resume can only come from the SIGTERM one.
    train = train_args(job_dir, "--steps", "30", "--save-every", "1000", "--step-time", "0.1")
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        [str(EXAMPLE), *train],
        template_args=(f"--ft-relaunch={mode}", "--ft-max-job-relaunches=2"),
    )
    chain.wait_progress(rank=0, steps=3, timeout=ONE_RUN_S)
    running = chain.leftover_processes()  # the check at the end can see job processes
    assert {"slurmstepd", "ft_launcher"} <= {p.split(":", 1)[1] for p in running}, running

    # What --signal=B:TERM@N does before a time limit, and a preemption notice: SIGTERM to
    # the batch shell only. The template forwards it to the launchers.
    slurm_cluster.run("scancel", "--signal=TERM", "--batch", chain.first_job)
    history = chain.wait_stopped(TWO_RUNS_S)

    assert [r["decision"] for r in history] == ["relaunch", "stop"], chain.describe()
    first, second = history
    assert first["codes"] == [75, 75] and first["exit_code"] == 75  # preempted, relaunch me
    assert second["reason"].startswith("training finished")
    before, after = split_at_resume(steps_of(chain))
    assert before == list(range(1, len(before) + 1)), before
    assert after == list(range(before[-1] + 1, 31)), (before, after)  # from the SIGTERM save
    if mode == "requeue":
        assert second["job_id"] == first["job_id"] == first["next_job_id"]
        assert slurm_cluster.job_info(chain.first_job)["Restarts"] == "1"
    else:
        assert second["job_id"] == first["next_job_id"] != first["job_id"]
        assert chain.state(first["job_id"]) == ("FAILED", "75:0")
    assert chain.state(second["job_id"]) == ("COMPLETED", "0:0")
    chain.assert_no_processes_left()


@pytest.mark.slurm
def test_time_limit_signal_relaunches_the_job(slurm_cluster, tmp_path: Path):
    # The real thing: --signal=B:TERM@50 with a 1-minute limit reaches the batch shell 10-30 s
    # after the start. The first run waits for it; the relaunched run exits 0 at once.
    workload = 'if [ "$FTRUN_JOB_RUN" = 0 ]; then exec sleep 300; fi'
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        [*QUICK, "bash", "-c", workload],
        sbatch_args=("--time=1", "--signal=B:TERM@50"),
        template_args=("--ft-finished-flag=none", "--ft-max-job-relaunches=1"),
        # Options the relaunched job gets on top of those Slurm recorded for this one.
        env=job_env(slurm_cluster, FTRUN_SBATCH_ARGS="--time=5 --signal=B:TERM@60"),
    )

    history = chain.wait_stopped(TWO_RUNS_S)

    assert [r["decision"] for r in history] == ["relaunch", "stop"], chain.describe()
    first, second = history
    # 75: preempted. 143: a launcher still importing torch when the signal came (Slurm may
    # send it up to a minute early, seen 4 s after the start here) died by it.
    assert set(first["codes"]) <= {75, 143} and first["ending"] == "running", first
    assert second["codes"] == [0, 0] and second["reason"] == "all launchers succeeded"
    # The first job ended on its own before the limit (FAILED), not killed (TIMEOUT).
    assert chain.state(first["job_id"])[0] == "FAILED"
    assert slurm_cluster.job_info(second["job_id"])["TimeLimit"] == "00:05:00"
    assert chain.state(second["job_id"]) == ("COMPLETED", "0:0")
    chain.assert_no_processes_left()


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("case", "launcher_args", "exit_code"),
    [
        pytest.param("finished", [*QUICK, "true"], "0:0", id="finished-before-start"),
        pytest.param(
            "do_not_relaunch",
            # n2 fails its health check: its launcher exits 3 (n1 sees the rendezvous fail
            # without n2). The job's own --exclude=n3 leaves no node to take n2's place, so
            # n2 cannot be kept out of a relaunch: its 3 stands.
            [*QUICK, UNHEALTHY_N2, "true"],
            "3:0",
            id="do-not-relaunch",
        ),
        pytest.param("usage", ["--no-such-flag", "true"], "2:0", id="usage"),
    ],
)
def test_job_is_not_relaunched(slurm_cluster, tmp_path, case, launcher_args, exit_code):
    if case == "finished":  # e.g. a relaunch that arrives after the training completed
        (tmp_path / "job" / "ckpt").mkdir(parents=True)
        (tmp_path / "job" / "ckpt" / "FINISHED").write_text("8\n")
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        launcher_args,
        sbatch_args=("--exclude=n3",) if case == "do_not_relaunch" else (),
        template_args=("--ft-max-job-relaunches=2",),
    )

    history = chain.wait_stopped(ONE_RUN_S)

    assert [r["decision"] for r in history] == ["stop"], chain.describe()
    assert chain.job_ids() == [chain.first_job]
    state = "COMPLETED" if case == "finished" else "FAILED"
    assert chain.state(chain.first_job) == (state, exit_code)
    codes = history[0]["codes"]
    if case == "finished":
        assert codes == [None, None]  # the launchers never started
    elif case == "do_not_relaunch":
        assert codes[1] == 3 and history[0]["exclude"] == [], chain.describe()
        assert history[0]["reason"].endswith("n2 judged unhealthy, too few nodes to exclude")
        assert "2-node job: not excluding n2" in chain.output(chain.first_job)
    else:
        assert codes == [2, 2]
    chain.assert_no_processes_left()


@pytest.mark.slurm
def test_unhealthy_node_is_kept_out_of_the_relaunched_job(slurm_cluster, tmp_path: Path):
    """n2 fails its health check in the first job (n1 cannot go on alone): the job is
    relaunched with --exclude=n2, runs on n1 and n3, whose checks pass, and finishes."""
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        [*QUICK, UNHEALTHY_N2, "true"],
        sbatch_args=("--nodelist=n1,n2",),
        template_args=("--ft-finished-flag=none", "--ft-max-job-relaunches=1"),
    )

    history = chain.wait_stopped(TWO_RUNS_S)

    assert [r["decision"] for r in history] == ["relaunch", "stop"], chain.describe()
    first, second = history
    assert first["nodes"] == ["n1", "n2"] and first["codes"][1] == 3, chain.describe()
    assert list(first["unhealthy"]) == ["n2"] and first["exclude"] == ["n2"], first
    info = slurm_cluster.job_info(second["job_id"])
    nodes = slurm_cluster.run("scontrol", "show", "hostnames", info["NodeList"]).stdout.split()
    assert info["ExcNodeList"] == "n2" and nodes == ["n1", "n3"], info
    assert second["codes"] == [0, 0] and second["reason"] == "all launchers succeeded"
    assert "n2 judged unhealthy in this run: unhealthy:" in chain.output(first["job_id"])
    assert (tmp_path / "job" / "excluded-nodes").read_text().splitlines()[-1].startswith("n2 ")
    chain.assert_no_processes_left()


@pytest.mark.slurm
def test_failing_job_stops_after_max_job_relaunches(slurm_cluster, tmp_path: Path):
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        [*QUICK, "false"],  # every worker fails at once, in every run
        template_args=("--ft-max-job-relaunches=2",),
    )

    history = chain.wait_stopped(3 * ONE_RUN_S)

    assert [r["decision"] for r in history] == ["relaunch", "relaunch", "stop"], chain.describe()
    assert [r["relaunches"] for r in history] == [1, 2, 2]
    assert "relaunch budget spent (2 of 2)" in history[-1]["reason"]
    assert len(set(chain.job_ids())) == 3
    for job_id in chain.job_ids():
        assert chain.state(job_id) == ("FAILED", "1:0")
    chain.assert_no_processes_left()


@pytest.mark.slurm
def test_cancelled_job_is_not_relaunched(slurm_cluster, tmp_path: Path):
    job_dir = tmp_path / "job"
    train = train_args(job_dir, "--steps", "200", "--step-time", "0.1")
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        [str(EXAMPLE), *train],
        template_args=("--ft-max-job-relaunches=2",),
    )
    chain.wait_progress(rank=0, steps=2, timeout=ONE_RUN_S)

    slurm_cluster.run("scancel", chain.first_job)  # a person's scancel: SIGTERM to everything
    slurm_cluster.wait_job_state(chain.first_job, "CANCELLED", timeout=60)

    # The batch script had KillWait (2 s) to decide; if it did, it decided to stop.
    history = chain.history
    assert [r["decision"] for r in history] in ([], ["stop"]), chain.describe()
    if history:
        assert history[0]["ending"] == "cancelled"
    assert chain.job_ids() == [chain.first_job]
    chain.assert_no_processes_left()


@pytest.mark.slurm
def test_the_first_launcher_and_the_store_lost_within_one_allocation(slurm_cluster, tmp_path):
    """3 nodes, --nnodes=2: n1 and n2 train (infra ranks 0 and 1), n3 stands by; the store is
    `ftrun store` in a step of its own (the template's default). n1's launcher and its workers
    die: n3 takes its slot. Then the store process dies: srun starts it again, the launchers
    write the job's state back into it and go on. The job ends COMPLETED, never relaunched."""
    job_dir = tmp_path / "job"
    train = train_args(job_dir, "--steps", "90", "--step-time", "0.1", "--save-every", "5")
    chain = submit_chain(
        slurm_cluster,
        tmp_path,
        ["--nnodes=2", "--max-restarts=3", str(EXAMPLE), *train],
        sbatch_args=("--nodes=3",),
        template_args=("--ft-max-job-relaunches=2",),
    )
    chain.wait_progress(0, 5, ONE_RUN_S)
    assert not any(e.get("store_host") for e in chain.events("rendezvous_done"))
    launcher = chain.launcher_of("n1")  # the first node: where the store used to live
    for proc in [launcher, *launcher.children(recursive=True)]:  # the node dies
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    wait_for(lambda: any(e["cycle"] == 1 for e in chain.events("rendezvous_done")), ONE_RUN_S,
             "the standby in n1's slot")  # fmt: skip
    chain.wait_progress(0, 30, ONE_RUN_S)
    chain.store_process().kill()
    wait_for(lambda: len(chain.events("store_restarted")) >= 2, ONE_RUN_S, "the store back")

    history = chain.wait_stopped(ONE_RUN_S)

    assert [r["decision"] for r in history] == ["stop"], chain.describe()
    assert chain.job_ids() == [chain.first_job]  # no relaunch: one allocation
    assert chain.state(chain.first_job) == ("COMPLETED", "0:0"), chain.describe()
    codes = dict(zip(("n1", "n2", "n3"), history[0]["codes"], strict=True))
    assert codes.pop("n1") != 0 and set(codes.values()) == {0}, chain.describe()
    assert (job_dir / "ckpt" / "FINISHED").exists()
    store_log = next(job_dir.glob("runs/*/store.log")).read_text()
    assert store_log.count("serving the rendezvous store") == 2, store_log
    assert "rendezvous store: ftrun store on" in chain.output(chain.first_job)
    chain.assert_no_processes_left()
