"""The fork server across cycles, through real launchers: warm restarts whatever the threads
environment, and a first cycle that never waits for the deep warm-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.agent.node_services.compile_cache import torch_default_cache_dir
from launch import ROOT, Job, start_job

pytestmark = pytest.mark.process

PROBE = ROOT / "tests" / "workers" / "prewarm_probe.py"
TIMEOUT = 90


def cycle_record(job_dir: Path, cycle: int) -> dict:
    return json.loads((job_dir / f"cycle{cycle}.json").read_text())


def crash_once(tmp_path: Path, prewarm: str, deep: str, probe: str) -> Job:
    """One launcher, one worker that crashes in its first cycle and ends well in the second;
    the probe imports `probe` and records each cycle (`prewarm_probe.py`)."""
    job = start_job(
        tmp_path, 1, ["--max-restarts=1", f"--ft-prewarm-modules={prewarm}",
                      f"--ft-prewarm-deep-modules={deep}"],
        ["--modules", probe],
        script=PROBE,
    )  # fmt: skip
    try:
        assert job.wait(TIMEOUT) == [0], job.nodes[0].text()
    finally:
        job.kill()
    return job


def test_one_worker_per_node_with_omp_unset_restarts_warm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy's OpenBLAS starts a thread per CPU at import unless told otherwise: the server
    imports it limited, and each forked worker gets the pool its own environment asks for."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    plain = subprocess.run(
        [sys.executable, "-c", "import numpy, os; print(len(os.listdir('/proc/self/task')))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    job = crash_once(tmp_path, prewarm="numpy", deep="none", probe="numpy")
    started = job.events("workers_started")
    assert [(e["cycle"], e["path"], e["why"]) for e in started] == [
        (0, "forked", None),
        (1, "forked", None),
    ], job.nodes[0].text()
    for cycle in (0, 1):
        assert cycle_record(job.ckpt_dir, cycle)["threads"] == int(plain.stdout), cycle
    assert "workers forked" in job.nodes[0].text()


def test_first_cycle_never_waits_for_the_deep_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deep module takes seconds to import: the first cycle's worker runs before it is
    done, and the restarted worker is forked after it, with the module already imported."""
    mark = tmp_path / "deep-imported"
    monkeypatch.setenv("SLOW_PREWARM_MARK", str(mark))
    monkeypatch.setenv("SLOW_PREWARM_S", "3")
    job = crash_once(tmp_path, prewarm="json", deep="slow_prewarm_module",
                     probe="slow_prewarm_module")  # fmt: skip
    first, restarted = cycle_record(job.ckpt_dir, 0), cycle_record(job.ckpt_dir, 1)
    deep_done = float(mark.read_text())
    assert first["started"] < deep_done and first["imported"] == []
    assert restarted["started"] > deep_done
    assert restarted["imported"] == ["slow_prewarm_module"]
    paths = [e["path"] for e in job.events("workers_started")]
    assert paths == ["forked", "forked"], job.nodes[0].text()


def test_workers_of_every_cycle_get_the_private_cache_when_torchs_is_unsafe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's default cache directory open to everyone's writes: the workers of every cycle
    get the user's private one instead (the decisions: tests/test_compile_cache.py); a user's
    own TRITON_CACHE_DIR is kept."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    open_to_all = torch_default_cache_dir({"TMPDIR": str(tmp_path)})
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    probe = tmp_path / "env_probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "names = ('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR')\n"
        "out = sys.argv[sys.argv.index('--ckpt-dir') + 1]\n"
        "os.makedirs(out, exist_ok=True)\n"
        "path = os.path.join(out, 'cycle' + os.environ['FTRUN_CYCLE'] + '.json')\n"
        "open(path, 'w').write(json.dumps({n: os.environ.get(n) for n in names}))\n"
        "sys.exit(1 if os.environ['FTRUN_CYCLE'] == '0' else 0)\n"
    )
    job = start_job(tmp_path, 1, ["--max-restarts=1", "--ft-prewarm-modules=json"],
                    script=probe)  # fmt: skip
    try:
        assert job.wait(TIMEOUT) == [0], job.nodes[0].text()
    finally:
        job.kill()
    seen = [cycle_record(job.ckpt_dir, cycle) for cycle in (0, 1)]
    assert seen[0] == seen[1]
    private = tmp_path / f"ftrun-compile-{os.getuid()}"
    assert seen[0]["TORCHINDUCTOR_CACHE_DIR"] == str(private)
    assert private.stat().st_mode & 0o777 == 0o700
    assert seen[0]["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert "others can write to" in job.nodes[0].text()


def test_a_restarted_rank_starts_in_its_prestarted_worker(tmp_path: Path) -> None:
    """--ft-prestart-workers=on (auto where a GPU is): while cycle 0 runs, the fork server holds
    cycle 1's worker; the crash's restart runs the script there, with cycle 1's environment."""
    job = start_job(tmp_path, 1, ["--max-restarts=1", "--ft-prewarm-modules=psutil",
                                  "--ft-prestart-workers=on"],
                    script=ROOT / "tests" / "workers" / "prestart_probe.py")  # fmt: skip
    try:
        assert job.wait(TIMEOUT) == [0], job.nodes[0].text()
    finally:
        job.kill()
    crashed, restarted = cycle_record(job.ckpt_dir, 0), cycle_record(job.ckpt_dir, 1)
    assert restarted["created"] < crashed["crashed"], "the restarted worker was forked after"
    assert restarted["cycle_env"] == "1" and restarted["pid"] != crashed["pid"]
    paths = [e["path"] for e in job.events("workers_started")]
    assert paths == ["forked", "forked"], job.nodes[0].text()
