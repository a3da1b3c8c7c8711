"""GPU scenarios: NCCL crash and hang recovery, NVML health check, GPU memory reclaim, a lost
node replaced by a hot spare.

Two launchers on one host as two nodes, each with its own GPUs (`CUDA_VISIBLE_DEVICES`): one GPU
each (2 GPUs), and where 4 are present, two each. On one GPU the health check and the memory
reclaim run with one launcher; with two GPUs the spare takes the GPU of the node it replaces;
a scenario the GPUs present cannot hold is skipped with its reason. Run on a GPU machine with
`pytest tests/gpu -m gpu`; with FTRUN_GPU_REPORT=<file> each scenario appends its timings there
as a JSON line.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrun.errors import ExitCode, NodeUnhealthyError
from launch import EXAMPLE, Job, Node, node_of, start_job
from store_process import StoreProcess
from support import wait_for
from test_inprocess_jobs import run_twenty_faults
from test_observe_jobs import endpoints, scrape
from test_rerun_jobs import FLIP_STEP, STEPS, expected_w, progress
from test_spares import SPARE, lose, rounds, standby_nodes, wait_all

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
# NVLink multicast stays off everywhere: it can take shared GPUs out of service.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
TRAIN = ["--device", "cuda", "--steps", "60", "--save-every", "10", "--step-time", "0.02"]
START_S = 90
"""Until a job trains (the scenarios ran 20-55 s each on 4 x H200): a failure says why well
within a device call's 10 minutes."""
JOB_S = 150


GPUS = torch.cuda.device_count()
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs (two launchers)")
SPARE_GPUS = ["0", "1", "2" if GPUS >= 3 else "0"]
"""Launchers 0 and 1 train, launcher 2 stands by; on a 2-GPU host the spare has launcher 0's GPU,
which is free once launcher 0 (the node a spare test loses) is gone."""
PER_NODE = [
    pytest.param(1, id="2x1", marks=TWO_GPUS),
    pytest.param(2, id="2x2", marks=pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA GPUs")),
]
"""GPUs per launcher, two launchers on the host."""


def node_envs(per_node: int = 1, nodes: int = 2) -> list[dict[str, str]]:
    """Launcher i's own GPUs: i * per_node onwards."""
    return [{**NCCL_ENV, "CUDA_VISIBLE_DEVICES": ",".join(
        str(i * per_node + g) for g in range(per_node))} for i in range(nodes)]  # fmt: skip


def spare_job(
    tmp: Path, store: StoreProcess, script_args: list[str], script: Path = EXAMPLE
) -> tuple[Job, Node]:
    """Three launchers of one GPU each, ranked by GROUP_RANK (0 and 1 train, 2 stands by), and
    the node to lose: group rank 0 (`store` serves the rendezvous off the nodes, so that no
    launcher holds it, whichever would have)."""
    envs = [{**NCCL_ENV, "GROUP_RANK": str(i), "CUDA_VISIBLE_DEVICES": gpu}
            for i, gpu in enumerate(SPARE_GPUS)]  # fmt: skip
    job = start_job(tmp, 3, [*SPARE, "--ft-use-infra-group-rank", *store.launcher_args],
                    script_args, script=script, node_env=envs)  # fmt: skip
    return job, job.nodes[0]


def _tails(job: Job) -> str:
    """Each launcher's last lines, for a scenario that stopped short."""
    return "\n".join(f"--- launcher {n.index}\n{n.text()[-1500:]}" for n in job.nodes)


def report(name: str, **figures: object) -> None:
    path = os.environ.get("FTRUN_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": name, **figures}) + "\n")


def recovery_figures(job: Job, world: int = 2) -> dict[str, float]:
    """Failure -> stopped -> all workers started -> all ranks stepping again (seconds)."""
    failure = min(e["ts"] for e in job.events() if e["event"] in ("hang", "worker_exited")
                  and (e["event"] == "hang" or e["code"] != 0))  # fmt: skip
    stopped = max(e["ts"] for e in job.events("stop_done") if e["cycle"] == 0)
    started = max(e["ts"] for e in job.events("workers_started") if e["cycle"] == 1)
    stepping = max(
        min(float(t) for c, _, t in _rows(job, rank) if int(c) == 1) for rank in range(world)
    )
    return {
        "stop_s": round(stopped - failure, 3),
        "restart_s": round(started - failure, 3),
        "first_step_again_s": round(stepping - failure, 3),
    }


def _rows(job: Job, rank: int) -> list[list[str]]:
    return [r.split() for r in (job.ckpt_dir / f"progress-rank{rank}.txt").read_text().splitlines()]


@pytest.mark.parametrize("per_node", PER_NODE)
def test_a_crash_restarts_and_nccl_reinitialises(tmp_path: Path, per_node: int):
    last = 2 * per_node - 1  # on the second launcher
    job = start_job(tmp_path, 2, ["--max-restarts=2"], [*TRAIN, "--crash", f"0:{last}:20"],
                    nproc=per_node, node_env=node_envs(per_node))  # fmt: skip
    assert job.wait(JOB_S) == [0, 0], job.nodes[1].text()[-3000:]
    assert (job.ckpt_dir / "FINISHED").exists()
    report(f"crash, 2x{per_node} GPUs", **recovery_figures(job, 2 * per_node))


@pytest.mark.parametrize("per_node", PER_NODE)
def test_b_hang_inside_nccl_is_pinned_on_the_sleeping_rank(tmp_path: Path, per_node: int):
    last = 2 * per_node - 1
    args = ["--max-restarts=2", "--ft-rank-heartbeat-timeout=3"]
    job = start_job(tmp_path, 2, args, [*TRAIN, "--hang-collective", f"0:{last}:20"],
                    nproc=per_node, node_env=node_envs(per_node))  # fmt: skip
    assert job.wait(JOB_S) == [0, 0], job.nodes[1].text()[-3000:]
    hangs = {e["rank"]: e for e in job.events("hang")}
    assert "sleep_before_all_reduce" in Path(hangs[last]["stack_file"]).read_text()
    report(
        f"hang in NCCL all_reduce, 2x{per_node} GPUs",
        detection_latency_s=hangs[last]["detection_latency"],
        waited_s=hangs[last]["waited"],
        peer_stack=Path(hangs[0]["stack_file"]).read_text()[-600:] if 0 in hangs else "",
        **recovery_figures(job, 2 * per_node),
    )


def test_c_nvml_health_check_passes_and_is_cheap():
    from ftrun.agent.node_services.health import check_gpus

    assert check_gpus(nvlink=False) >= GPUS
    costs = []
    for _ in range(10):
        started = time.perf_counter()
        check_gpus()
        costs.append(time.perf_counter() - started)
    try:
        nvlink = f"ok, {check_gpus(nvlink=True)} GPUs"
    except NodeUnhealthyError as exc:
        nvlink = str(exc)  # reported, not asserted: which links exist depends on the host
    median_ms = round(statistics.median(costs) * 1e3, 2)
    report("NVML health check", gpus=check_gpus(), median_ms=median_ms, nvlink=nvlink)


def test_d_restart_waits_for_gpu_memory_to_be_released(tmp_path: Path):
    """On one GPU, one launcher; otherwise two, a GPU each."""
    args = ["--max-restarts=2", "--ft-gpu-memory-reclaim-timeout=30"]
    script = [*TRAIN, "--crash", "0:0:20", "--ballast-mb", "4096"]
    nodes = min(GPUS, 2)
    job = start_job(tmp_path, nodes, args, script, node_env=node_envs(1, nodes))
    assert job.wait(JOB_S) == [0] * nodes, job.nodes[0].text()[-3000:]
    reclaims = job.events("gpu_memory_reclaimed")
    assert reclaims and all(e["released"] for e in reclaims)
    report(
        "GPU memory reclaim",
        reclaim_s=[e["duration"] for e in reclaims],
        **recovery_figures(job, nodes),
    )


@TWO_GPUS
def test_e_a_lost_node_is_replaced_by_the_spare_and_nccl_spans_it(
    tmp_path: Path, store_process: StoreProcess
):
    """Three launchers of one GPU each, two active: one dies with its workers; the spare takes
    its slot and NCCL runs between the survivor and the spare."""
    job, victim = spare_job(tmp_path, store_process, [*TRAIN, "--steps", "80"])
    progress = job.ckpt_dir / "progress-rank0.txt"
    deadline = time.monotonic() + START_S
    while not (progress.exists() and len(progress.read_text().splitlines()) >= 10):
        assert time.monotonic() < deadline, f"no training on 2 nodes: {_tails(job)}"
        time.sleep(0.2)
    first = rounds(job)[0]
    lose(victim)
    lost_at = time.time()
    codes = wait_all(job, JOB_S)
    assert codes == {n.index: -9 if n is victim else 0 for n in job.nodes}, _tails(job)
    spare = standby_nodes(job, 0).pop()
    final = rounds(job)[max(rounds(job))]
    assert spare in final and node_of(job, spare) is not victim and len(final) == len(first)
    assert (job.ckpt_dir / "FINISHED").exists()
    again = max(e["ts"] for e in job.events("workers_started") if e["cycle"] == max(rounds(job)))
    report("node lost, spare takes its slot (NCCL)", spare_started_s=round(again - lost_at, 3))


@TWO_GPUS
def test_f_a_lost_nodes_cuda_state_is_restored_on_the_spare_from_its_peer_replica(
    tmp_path: Path, store_process: StoreProcess
):
    """Local checkpoints of GPU tensors (`LocalCheckpointManager`, replicated to the next node):
    a node is lost; the spare fetches the lost rank's part from the survivor's replica and
    every rank resumes from the same iteration, on its GPU."""
    worker = Path(__file__).resolve().parents[1] / "workers" / "ckpt_worker.py"
    args = ["--device", "cuda", "--steps", "80", "--step-time", "0.05", "--mb", "64"]
    job, victim = spare_job(tmp_path, store_process, args, script=worker)
    deadline = time.monotonic() + START_S
    while len(job.events("ckpt_replicated")) < 4:
        assert time.monotonic() < deadline, f"no replicated checkpoints: {_tails(job)}"
        time.sleep(0.2)
    lose(victim)
    codes = wait_all(job, JOB_S)
    assert codes == {n.index: -9 if n is victim else 0 for n in job.nodes}, _tails(job)
    after = [e for e in job.events("ckpt_restore") if e["cycle"] == 1]
    assert len({e["iteration"] for e in after}) == 1 and after[0]["iteration"] >= 5
    assert any(e.get("fetched") for e in after)  # the spare fetched the lost rank's part
    report("CUDA state restored on the spare from a peer's replica",
           iteration=after[0]["iteration"])  # fmt: skip


BUSY = ("import torch\nm = torch.ones(8192, 8192, device='cuda')\ntorch.cuda.synchronize()\n"
        "print('busy', flush=True)\nwhile True:\n    torch.mm(m, m)\n")  # fmt: skip
"""A neighbour that keeps one GPU busy with large matrix products: the GPU shares its time
with the rank's. It says `busy` once its kernels run (its CUDA start takes seconds: a job
started before that could finish unslowed)."""


@pytest.mark.parametrize("per_node", PER_NODE)
def test_g_a_gpu_slowed_by_a_busy_neighbour_is_named_by_the_straggler_detector(
    tmp_path: Path, per_node: int
):
    worker = Path(__file__).resolve().parents[1] / "workers" / "straggler_worker.py"
    last = 2 * per_node - 1  # its GPU: the second launcher's last
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(last)}
    busy = subprocess.Popen([sys.executable, "-c", BUSY], env=env, stdout=subprocess.PIPE)
    try:
        assert busy.stdout is not None and select.select([busy.stdout], [], [], START_S)[0]
        assert busy.stdout.readline() == b"busy\n"
        job = start_job(tmp_path, 2, ["--ft-straggler-report-interval=0.5"],
                        ["--device", "cuda", "--steps", "300"], script=worker, nproc=per_node,
                        node_env=node_envs(per_node))  # fmt: skip
        assert job.wait(JOB_S) == [0, 0], job.nodes[1].text()[-3000:]
    finally:
        busy.kill()
        busy.wait(10)
        if busy.stdout is not None:
            busy.stdout.close()
    found = job.events("straggler")
    assert found, "no straggler named"
    # The busy GPU is the second launcher's last; its rank follows that launcher's group rank,
    # which the rendezvous chose, not the launchers' order.
    busy_node = next(n for n in rounds(job)[0] if n.endswith(f"-{job.nodes[1].proc.pid}"))
    slowed = rounds(job)[0].index(busy_node) * per_node + per_node - 1
    named = "; ".join(
        f"seq {e['seq']}: " + ", ".join(
            f"rank {f['rank']} {f['kind']} {f['score']:.2f}" for f in e["findings"])
        for e in found)  # fmt: skip
    # The first report covers the job's warm-up: at 2x2 on 4 x H200 it named global ranks 2
    # and 3 worst, whichever launcher held them (bench/RESULTS.md); every later one names
    # the slowed rank alone.
    assert len(found) >= 2 and all(e["ranks"] == [slowed] for e in found[1:]), (
        f"expected {slowed}: {named}"
    )
    report(f"GPU slowed by a busy neighbour, 2x{per_node} GPUs", stragglers=len(found),
           first_seq=found[0]["seq"])  # fmt: skip


@TWO_GPUS
def test_h_a_result_reproduced_on_one_node_is_re_run_on_the_spare_over_nccl(
    tmp_path: Path, store_process: StoreProcess
):
    """The re-run state machine with NCCL: one rank's loss is wrong on its node's GPU (marked
    bad) and again when re-run there; it exits 16, the step is re-run on the spare, the verdict
    names the node, which is excluded, and every rank ends where a clean run ends."""
    worker = Path(__file__).resolve().parents[1] / "workers" / "rerun_worker.py"
    args = ["--device", "cuda", "--flip", f"marked:{FLIP_STEP}", "--steps", str(STEPS),
            "--step-time", "0.03"]  # fmt: skip
    job, victim = spare_job(tmp_path, store_process, args, script=worker)
    job.wait_event("rendezvous_done", 2)
    first = rounds(job)[0]
    name = next(n for n in first if n.endswith(f"-{victim.proc.pid}"))
    job.ckpt_dir.mkdir(parents=True, exist_ok=True)
    (job.ckpt_dir / "flip-rank").write_text(str(first.index(name)))
    (job.ckpt_dir / f"fail-{name}").write_text("")
    (job.ckpt_dir / "flip-armed").write_text("")
    codes = wait_all(job, JOB_S)
    assert codes == {n.index: ExitCode.EXCLUDED if n is victim else 0 for n in job.nodes}
    [verdict] = job.events("rerun_verdict")
    assert (verdict["diagnostic"], verdict["suspect_node"]) == ("persistent_error", name)
    for rank in range(2):
        rows = progress(job, rank)
        assert rows[-1][1] == STEPS
        assert rows[-1][3] == pytest.approx(expected_w(STEPS, world=2), rel=1e-4)
    report("re-run elsewhere over NCCL", verdict=verdict["diagnostic"])


@pytest.mark.parametrize("per_node", PER_NODE)
def test_i_each_launcher_watches_and_serves_its_own_gpus(tmp_path: Path, per_node: int):
    """Two launchers on one host: each one's health watch reads (and its metrics serve) the
    GPUs of its CUDA_VISIBLE_DEVICES, by NVML index, and no other."""
    job = start_job(tmp_path, 2, ["--ft-health-interval=0.5", "--ft-metrics-port=0"],
                    [*TRAIN, "--steps", "200"], nproc=per_node,
                    node_env=node_envs(per_node))  # fmt: skip
    try:
        urls = wait_for(lambda: len(found := endpoints(job)) == 2 and found, 120, "metrics URLs")

        def gpus_served() -> dict[str, set[str]] | None:
            seen = {node: {dict(labels)["gpu"] for name, labels in scrape(url)
                           if name == "ftrun_gpu_memory_used_bytes"}
                    for node, url in urls.items()}  # fmt: skip
            return seen if all(seen.values()) else None

        seen = wait_for(gpus_served, 60, "per-GPU series from both launchers")
        wanted = [set(env["CUDA_VISIBLE_DEVICES"].split(",")) for env in node_envs(per_node)]
        assert sorted(map(sorted, seen.values())) == sorted(map(sorted, wanted)), seen
        assert job.wait(JOB_S) == [0, 0], job.nodes[0].text()[-3000:]
    finally:
        job.kill()
    report(f"per-GPU metrics, 2x{per_node} GPUs", served=sorted(map(sorted, seen.values())))


@TWO_GPUS
def test_j_twenty_in_process_faults_leave_gpu_memory_threads_and_keys_at_their_baseline(
    tmp_path: Path,
):
    """torchrun, 2 ranks on 2 GPUs, a wrapped function that makes an NCCL group and its
    communicator each iteration and fails 20 times in a row (the peer waits in an all_reduce):
    from iteration 3 on, each iteration starts with the same OS threads and descriptors, the
    GPU's memory within 1 %, and the wrapper's store no fuller than one iteration's keys."""
    env = {**os.environ, **NCCL_ENV, "CUDA_VISIBLE_DEVICES": "0,1"}
    ranks = run_twenty_faults(tmp_path, "--device", "cuda", env=env, timeout=JOB_S)
    for rank, (_, fds, keys, tasks, gpu_mb) in enumerate(ranks):
        assert len(set(fds)) == 1 and len(set(tasks)) == 1, (fds, tasks)
        assert max(keys) - min(keys) <= 12, keys
        assert max(gpu_mb) - min(gpu_mb) <= 0.01 * min(gpu_mb), gpu_mb
        report(f"20 in-process faults, rank {rank}", gpu_mb=[min(gpu_mb), max(gpu_mb)],
               tasks=tasks[0], fds=fds[0])  # fmt: skip
