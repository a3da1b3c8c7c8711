"""GPU scenarios: NCCL crash and hang recovery, NVML health check, GPU memory reclaim.

Skipped without 2 CUDA GPUs. Run on a GPU machine with `pytest tests/gpu -m gpu`; with
FTRUN_GPU_REPORT=<file> each scenario appends its timings there as a JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest

from ftrun.errors import NodeUnhealthyError
from launch import Job, start_job

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
# NVLink multicast stays off everywhere: it can take shared GPUs out of service.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
TRAIN = ["--device", "cuda", "--steps", "60", "--save-every", "10", "--step-time", "0.02"]


def node_envs() -> list[dict[str, str]]:
    return [{**NCCL_ENV, "CUDA_VISIBLE_DEVICES": str(i)} for i in range(2)]


def report(name: str, **figures: object) -> None:
    path = os.environ.get("FTRUN_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": name, **figures}) + "\n")


def recovery_figures(job: Job) -> dict[str, float]:
    """Failure -> stopped -> all workers started -> all ranks stepping again (seconds)."""
    failure = min(e["ts"] for e in job.events() if e["event"] in ("hang", "worker_exited")
                  and (e["event"] == "hang" or e["code"] != 0))  # fmt: skip
    stopped = max(e["ts"] for e in job.events("stop_done") if e["cycle"] == 0)
    started = max(e["ts"] for e in job.events("workers_started") if e["cycle"] == 1)
    stepping = max(
        min(float(t) for c, _, t in _rows(job, rank) if int(c) == 1) for rank in range(2)
    )
    return {
        "stop_s": round(stopped - failure, 3),
        "restart_s": round(started - failure, 3),
        "first_step_again_s": round(stepping - failure, 3),
    }


def _rows(job: Job, rank: int) -> list[list[str]]:
    return [r.split() for r in (job.ckpt_dir / f"progress-rank{rank}.txt").read_text().splitlines()]


def test_a_crash_restarts_and_nccl_reinitialises(tmp_path: Path):
    job = start_job(tmp_path, 2, ["--max-restarts=2"], [*TRAIN, "--crash", "0:1:20"],
                    node_env=node_envs())  # fmt: skip
    assert job.wait(300) == [0, 0], job.nodes[1].text()[-3000:]
    assert (job.ckpt_dir / "FINISHED").exists()
    report("crash", **recovery_figures(job))


def test_b_hang_inside_nccl_is_pinned_on_the_sleeping_rank(tmp_path: Path):
    args = ["--max-restarts=2", "--ft-rank-heartbeat-timeout=3"]
    job = start_job(tmp_path, 2, args, [*TRAIN, "--hang-collective", "0:1:20"],
                    node_env=node_envs())  # fmt: skip
    assert job.wait(300) == [0, 0], job.nodes[1].text()[-3000:]
    hangs = {e["rank"]: e for e in job.events("hang")}
    assert "sleep_before_all_reduce" in Path(hangs[1]["stack_file"]).read_text()
    report(
        "hang in NCCL all_reduce",
        detection_latency_s=hangs[1]["detection_latency"],
        waited_s=hangs[1]["waited"],
        peer_stack=Path(hangs[0]["stack_file"]).read_text()[-600:] if 0 in hangs else "",
        **recovery_figures(job),
    )


def test_c_nvml_health_check_passes_and_is_cheap():
    from ftrun.agent.node_services.health import check_gpus

    assert check_gpus(nvlink=False) >= 2
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
    args = ["--max-restarts=2", "--ft-gpu-memory-reclaim-timeout=30"]
    script = [*TRAIN, "--crash", "0:0:20", "--ballast-mb", "4096"]
    job = start_job(tmp_path, 2, args, script, node_env=node_envs())
    assert job.wait(300) == [0, 0], job.nodes[0].text()[-3000:]
    reclaims = job.events("gpu_memory_reclaimed")
    assert reclaims and all(e["released"] for e in reclaims)
    report(
        "GPU memory reclaim",
        reclaim_s=[e["duration"] for e in reclaims],
        **recovery_figures(job),
    )
