"""In-process restart with real processes (gloo on 127.0.0.1): a wrapped training function
(tests/workers/inprocess_worker.py) recovers inside the same processes, under `ft_launcher`
(2 nodes x 2 ranks) and under `torchrun`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launch import Job, free_port, start_job
from support import run_dumping_stacks

pytestmark = pytest.mark.process

WORKER = Path(__file__).resolve().parent / "workers" / "inprocess_worker.py"
STEPS, FAULT_STEP = 60, 20


def steps(out: Path, rank: int) -> list[tuple[int, int, int, float]]:
    """(pid, restart iteration, step, time) of each step rank `rank` made."""
    rows = [line.split() for line in (out / f"steps-rank{rank}.txt").read_text().splitlines()]
    return [(int(p), int(i), int(s), float(t)) for p, i, s, t in rows]


def assert_recovered_in_place(
    out: Path, ranks: int, replaced: int | None = None, redone: int = 0
) -> None:
    """Every step once (up to `redone` steps twice at the fault: a snapshot a step behind), in
    restart iteration 1 from the fault on; each rank in one process, but `replaced`, whose
    process was started again at the fault."""
    for rank in range(ranks):
        rows = steps(out, rank)
        made = [s for _, _, s, _ in rows]
        assert sorted(set(made)) == list(range(STEPS)), f"rank {rank} lost a step"
        assert len(made) - STEPS <= redone, f"rank {rank} redid {len(made) - STEPS} steps"
        pids = [pid for pid, *_ in rows]
        assert len(set(pids)) == (2 if rank == replaced else 1), f"rank {rank}'s processes"
        assert {i for _, i, s, _ in rows if s >= FAULT_STEP} == {1}


def start(tmp_path: Path, *worker_args: str) -> Job:
    return start_job(tmp_path, 2, ["--max-restarts=1"],
                     ["--steps", str(STEPS), "--fault-step", str(FAULT_STEP), *worker_args],
                     script=WORKER, nproc=2)  # fmt: skip


def test_a_raise_in_one_rank_restarts_every_rank_in_its_process(tmp_path: Path):
    """The function resumes from a StepSnapshot: the model as of the step before the fault."""
    job = start(tmp_path, "--fault", "raise", "--fault-rank", "1", "--snapshot")
    assert job.wait(120) == [0, 0]
    assert_recovered_in_place(job.ckpt_dir, 4, redone=1)
    assert len(job.events("rendezvous_done")) == 2  # one cycle, no in-job restart
    assert "in-process restart: iteration 0 -> 1" in "".join(n.text() for n in job.nodes)
    report = job.report()
    assert "In-process restarts" in report
    assert "iteration 0 -> 1: EXCEPTION from rank 1 | in-process |" in report


def test_a_hang_judged_by_the_rank_monitor_is_recovered_in_process(tmp_path: Path):
    job = start_job(tmp_path, 2, ["--max-restarts=1", "--ft-rank-heartbeat-timeout=2"],
                    ["--steps", str(STEPS), "--fault-step", str(FAULT_STEP), "--heartbeats",
                     "--fault", "hang", "--fault-rank", "3"], script=WORKER, nproc=2)  # fmt: skip
    assert job.wait(120) == [0, 0]
    assert_recovered_in_place(job.ckpt_dir, 4)
    assert len(job.events("rendezvous_done")) == 2  # the agent did not restart the workers
    assert "the wrapped ranks restart iteration 0" in "".join(n.text() for n in job.nodes)


def test_a_sigkilled_rank_alone_is_started_again_and_joins_the_others(tmp_path: Path):
    """The new process of the killed rank reads its snapshot from node memory (the agent's)."""
    job = start(tmp_path, "--fault", "kill", "--fault-rank", "1", "--snapshot")
    assert job.wait(120) == [0, 0]
    assert_recovered_in_place(job.ckpt_dir, 4, replaced=1, redone=1)
    assert len(job.events("rendezvous_done")) == 2  # no in-job restart
    [replaced] = job.events("rank_replaced")
    assert replaced["rank"] == 1 and "SIGKILL" in replaced["cause"]
    assert "TERMINATED from rank 1 | replace rank 1 |" in job.report()


def test_under_torchrun_the_wrapper_recovers_on_its_own(tmp_path: Path):
    out, port = tmp_path / "out", free_port()  # it and the two after it: the stores' ports
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(WORKER),
           "--ckpt-dir", str(out), "--steps", str(STEPS), "--fault-step", str(FAULT_STEP),
           "--fault", "raise", "--fault-rank", "0", "--store-port", str(port + 1)]  # fmt: skip
    run = run_dumping_stacks(cmd, 120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_recovered_in_place(out, 2)


def run_twenty_faults(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> list[list[tuple[int, ...]]]:
    """tests/workers/inprocess_faults_worker.py under torchrun, 2 ranks, 20 faults in a row:
    each rank's counts from iteration 3 on, one tuple per column (threads, fds, keys, OS
    threads, GPU MB), once every rank entered iterations 0-20 in turn."""
    out, port = tmp_path / "out", free_port()  # it and the one after it: the stores' ports
    worker = WORKER.with_name("inprocess_faults_worker.py")
    # The wrapper's store on a port free_port() chose, not torchrun's MASTER_PORT + 1 (in the
    # ephemeral range: under the suite's load something else once held it, and both ranks hung
    # validating against it).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(worker),
           "--out", str(out), "--faults", "20", "--store-port", str(port + 1), *args]  # fmt: skip
    run = run_dumping_stacks(cmd, timeout, env)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = []
    for rank in range(2):
        lines = (out / f"resources-rank{rank}.txt").read_text().splitlines()
        rows = [[int(v) for v in line.split()] for line in lines]
        assert [row[0] for row in rows] == list(range(21)), (rows, run.stdout[-6000:])
        ranks.append(list(zip(*rows[3:], strict=True))[1:])
    return ranks


def test_twenty_faults_leave_no_threads_descriptors_or_store_keys_behind(tmp_path: Path):
    """Under torchrun, 2 ranks, a function that raises 20 times in a row (no process group):
    each iteration's threads and descriptors are the last one's, and the wrapper's store keeps
    at most the last iterations' keys (it forgets each two iterations on)."""
    for threads, fds, keys, _, _ in run_twenty_faults(tmp_path):
        assert len(set(threads)) == 1 and len(set(fds)) == 1, (threads, fds)
        # One iteration's keys may still be there as an iteration starts (its tidying runs
        # beside the function); 17 faults unforgotten would be over a hundred.
        assert max(keys) - min(keys) <= 12, keys


MISTAKES = WORKER.with_name("inprocess_mistakes_worker.py")


def test_an_unannotated_call_wrapper_is_one_warning_and_the_job_runs(tmp_path: Path):
    """NVRx passes it nothing, and every entry failed: 7,874 restarts in 3 minutes."""
    job = start_job(tmp_path, 1, [], ["--mistake", "unannotated"], script=MISTAKES, nproc=2)
    assert job.wait(60) == [0]
    assert (job.ckpt_dir / "done").exists()
    text = job.nodes[0].text()
    assert text.count("is not annotated CallWrapper") == 2, text  # one line a rank
    assert not job.events("inprocess_recovered")


def test_a_function_that_fails_at_every_entry_takes_the_next_rungs_then_the_jobs_exit(
    tmp_path: Path,
):
    """The same fault ending 3 iterations in a row (--ft-max-same-failure) leaves the
    in-process tier at once, naming it; the in-job restarts then stop at the same failure
    (exit 6, REPEATED_FAILURE): a bounded, short log."""
    job = start_job(tmp_path, 1, ["--max-restarts=5"], ["--mistake", "raise-always"],
                    script=MISTAKES, nproc=2)  # fmt: skip
    assert job.wait(60) == [6]
    text = job.nodes[0].text()
    assert len(text.splitlines()) < 100, text
    cycles = len(job.events("rendezvous_done"))
    recovered = job.events("inprocess_recovered")
    assert len(recovered) == 2 * cycles, recovered  # two restarts a cycle, the third fault ends it
    assert "the same fault ended 3 iterations in a row: EXCEPTION: ValueError: the data path " \
           "is wrong" in text  # fmt: skip
    assert {e["why"][:25] for e in job.events("inprocess_gave_up")} == {"the same fault ended 3 it"}


def test_a_plain_init_process_group_reads_no_earlier_iterations_keys(tmp_path: Path):
    """env://, no store prefix: torch names the default group "0" again in every iteration, and
    its gloo rendezvous read the last iteration's keys in the launcher's store (3 of 5 runs hung
    before the wrapper named each iteration's groups apart)."""
    job = start_job(tmp_path, 1, ["--ft-max-same-failure=0"], ["--mistake", "plain-init-raises"],
                    script=MISTAKES, nproc=2)  # fmt: skip
    assert job.wait(60) == [0]
    assert (job.ckpt_dir / "done").read_text() == "3\n"  # iterations 0-2 failed, 3 completed
    assert len(job.events("inprocess_recovered")) == 3
