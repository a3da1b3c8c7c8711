"""Fault matrix, exhausted resources (issue 54): a rank out of descriptors or memory, an agent
starved of CPU by its workers' node, the launchers' log disk full, node memory (/dev/shm) full
under the step snapshots.

Each case runs the light 2-node x 1-rank job of `test_fault_workers`. A rank that runs out of a
resource fails as a user's script does (its error goes up): the job recovers in cycle 1 and
finishes. A starved agent is not a fault: the job finishes in one cycle, with no hang verdict
(a heartbeat read late is still a heartbeat received in time). A full log disk costs the
events written meanwhile, never the job. Full node memory costs the snapshots taken meanwhile,
never the training: a fault after it resumes from the newest complete one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conftest import matrix_only
from launch import Job, snapshot_rows
from support import wait_for

if TYPE_CHECKING:
    from conftest import Fault

pytestmark = pytest.mark.faults
SAME_AS_A_CRASH = matrix_only("test_worker_crash[exit_code]: a rank's error, then a restart")


@SAME_AS_A_CRASH
@pytest.mark.parametrize(
    ("flag", "error"),
    [("--out-of-fds", "Too many open files"), ("--out-of-memory", "MemoryError")],
    ids=["descriptors", "memory"],
)
def test_a_rank_out_of_a_resource_fails_and_the_job_recovers(fault: Fault, flag: str, error: str):
    job = fault.light([flag, "0:1:5"])
    failures = fault.recovered(job)
    assert [(e["event"], e["rank"], e["code"]) for e in failures] == [("worker_exited", 1, 1)]
    assert error in "".join(n.text() for n in job.nodes)


@matrix_only("nothing else: 6 spinning processes for the job's 4 s cost the suite 30 CPU-s")
def test_an_agent_starved_by_busy_workers_judges_no_hang(fault: Fault):
    """Each rank keeps 3 children spinning (6 on this VM's 2 cores, beside the agents and the
    store); heartbeats every 20 ms against a 1 s timeout: no verdict, no restart."""
    job = fault.light(["--busy", "3"], steps=("--steps", "150"))
    fault.expect = "one cycle, no hang"
    codes = job.wait(120)
    fault.track(job)
    assert codes == [0, 0], job.nodes[0].text()[-3000:]
    hangs = job.events("hang")
    # Whether the rank's heartbeats were late (its own progress lines stop before the
    # deadline) or only read late by its agent (they go on past it): say which, if it happens.
    steps = {r: (job.ckpt_dir / f"progress-rank{r}.txt").read_text().splitlines()[-60:]
             for r in (0, 1)}  # fmt: skip
    assert not hangs and not job.events("restart"), (hangs, steps)
    assert max(e["cycle"] for e in job.events("rendezvous_done")) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_log_disk_costs_the_events_not_the_job(fault: Fault, tmp_path: Path):
    """The launchers' --log-dir on a 2 MB tmpfs, filled while the ranks step; then rank 1 exits
    7: the agents detect it, restart, and the job finishes; what could not be written is said
    once a file, never as a traceback."""
    logs = tmp_path / "logs"
    logs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(logs)], check=True)
    try:
        job = fault.light(["--exit", "0:1:60:7", "--fault-after", "disk-full"])
        wait_for(lambda: len(job.progress(0)) >= 5, 60, "rank 0's 5th step")
        with contextlib.suppress(OSError), (logs / "filler").open("wb") as filler:
            while True:
                filler.write(bytes(2**16))
                filler.flush()
        (job.ckpt_dir / "disk-full").touch()
        fault.expect = "recovered, events lost"
        codes = job.wait(90)
        fault.track(job)
        assert codes == [0, 0], job.nodes[0].text()[-3000:]
        for rank in (0, 1):
            assert (job.ckpt_dir / f"done-rank{rank}").read_text() == "1\n", f"rank {rank}"
        for node in job.nodes:  # the events log may still fit in its last page: no count
            assert "Traceback" not in node.text(), node.text()[-3000:]
            assert node.text().count("worker output is no longer written to") <= 2
    finally:
        subprocess.run(["umount", "--lazy", str(logs)], check=False)


SNAPSHOT_WORKER = Path(__file__).resolve().parents[1] / "workers" / "snapshot_worker.py"
# Each launcher in a mount namespace of its own, /dev/shm a 96 MB tmpfs there: its node memory
# (the keeper keeps 64 MB free of replicas: `KeeperSettings.free_reserve_bytes`).
SMALL_SHM_BYTES = 96 << 20
SMALL_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f'mount -t tmpfs -o size={SMALL_SHM_BYTES} tmpfs /dev/shm && exec "$@"',
             "sh"]  # fmt: skip


@matrix_only("test_io_faults.py: a snapshot's failed write is said and the next one taken")
@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace and a tmpfs need root")
def test_full_node_memory_costs_the_snapshots_not_the_training(fault: Fault):
    """2 launchers x 1 rank of the StepSnapshot script, each launcher's /dev/shm a small tmpfs,
    full before the first save (every save and replica fails: a snapshot's files, once made,
    are reused, so memory filled later would cost only the replicas) and emptied at step 20;
    rank 1 raises at step 40: both ranks resume at the step they were in, bit-equal."""
    job = fault.start(2, ["--max-restarts=2", "--ft-rank-heartbeat-timeout=5"],
                      ["--steps", "60", "--step-time", "0.05", "--fault", "0:1:40:raise"],
                      script=SNAPSHOT_WORKER, wrap=SMALL_SHM)  # fmt: skip
    shm = [Path(f"/proc/{node.proc.pid}/root/dev/shm") for node in job.nodes]
    # Only the launchers' own tmpfs (another file system than this host's /dev/shm, which
    # `unshare` still shares until it has made the namespace), and never more than its size.
    host = os.stat("/dev/shm").st_dev
    wait_for(lambda: all(_own_memory(d, host) for d in shm), 60, "each launcher's node memory")
    for directory in shm:
        with contextlib.suppress(OSError), (directory / "filler").open("wb") as out:
            for _ in range(SMALL_SHM_BYTES // 2**16):
                out.write(bytes(2**16))
                out.flush()
    wait_for(lambda: _newest(job, 0) >= 20, 90, "step 20, no snapshot taken")
    for directory in shm:
        (directory / "filler").unlink()
    fault.expect = "snapshots failed, training went on; recovered from the newest"
    codes = job.wait(120)
    fault.track(job)
    assert codes == [0, 0], job.nodes[0].text()[-3000:]
    for rank in (0, 1):
        rows = snapshot_rows(job, rank)
        resumed = next(r for r in rows if r[0] == "resumed" and r[1] == 1)
        done = {s: d for kind, c, s, d in rows if kind == "step" and c == 0}
        assert resumed[2] >= 38 and resumed[3] == done[resumed[2]], (rank, resumed)
    for node in job.nodes:  # the launchers' own lines: the workers' (rank 1's raise) are relayed
        own = [line for line in node.text().splitlines() if not line.startswith("[default")]
        assert not [line for line in own if "Traceback" in line], node.text()[-3000:]
    stderr = "".join(p.read_text() for p in job.log_dir.glob("**/stderr.log"))
    assert "a step snapshot failed" in stderr, stderr[-2000:]


def _own_memory(directory: Path, host_device: int) -> bool:
    """`directory` is the launcher's tmpfs, with the agent's node memory in it."""
    with contextlib.suppress(OSError):
        return os.stat(directory).st_dev != host_device and any(directory.iterdir())
    return False


def _newest(job: Job, rank: int) -> int:
    return max((s for kind, _, s, _ in snapshot_rows(job, rank) if kind == "step"), default=0)
