"""Every bench's `--smoke` (bench/common/smoke.py): run as a user runs it, `python -m
bench.<folder>.<script> --smoke` from the repository root, it must exit 0 and print its table
header (or, a GPU bench without CUDA, the one line saying what it skipped). A change that breaks
a bench fails here instead of on the device months later.

The file's budget in `make test` is 40 test-seconds. The benches whose smallest real run is a
whole job of launchers and workers (tens of seconds each on 2 cores), and a few whose smoke
alone takes a fifth of the budget under the suite's load, do not fit it: they are skipped with
that reason unless FTRUN_BENCH_SMOKE=all is set, which runs every one (`make bench-smoke`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
ALL = os.environ.get("FTRUN_BENCH_SMOKE") == "all"
A_JOB = "a whole job of launchers and workers: over the file's 40 s budget"
OVER = "{} s here under the suite's load: over the file's 40 s budget"
NO_CUDA = "no CUDA here: skipped"


@dataclasses.dataclass(frozen=True)
class Smoke:
    module: str  # under bench.
    expect: str  # a regex the output must match: its table header, or its one line
    args: tuple[str, ...] = ()  # `{tmp}`: the test's own directory
    timeout: float = 90.0
    slow: str = ""  # why it does not fit the budget (run with FTRUN_BENCH_SMOKE=all)
    needs: str = ""  # a program it cannot run without


SMOKES = [
    Smoke("monitor.heartbeat", r"call\s+median us\s+target us"),
    Smoke("monitor.straggler", r"measure\s+ftrun\s+target\s+NVRx"),
    Smoke("monitor.straggler_gpu", rf"straggler_gpu: {NO_CUDA}|us per call\s+alone"),
    Smoke("monitor.health_watch", rf"health_watch: {NO_CUDA}|\| reading \| median"),
    Smoke("monitor.nvlink_check", rf"nvlink_check: {NO_CUDA}|NVLink verdict: "),
    Smoke("monitor.flight_recorder", r"\| backend \| all_reduce of 1024 floats",
          slow=OVER.format("6-14")),
    Smoke("monitor.rerun", r"\| on the training path \(CPU, one process\) \|",
          slow=OVER.format("2-9")),
    Smoke("monitor.live_view", r"### Metrics scrape(.|\n)*### The status page",
          ("--parts", "scrape", "page"), slow=OVER.format("4-13")),
    Smoke("checkpoint.checkpoint", r"measurement\s+s\s+GB/s\s+x floor", ("--json", "{tmp}/c.json")),
    Smoke("checkpoint.restore_floor", r"\| measurement \| 4 MiB: s \| x memcpy \|",
          slow=OVER.format("3-7")),
    Smoke("checkpoint.async_global", r"per rank, CPU\s+seconds \(median\)",
          ("--json", "{tmp}/a.json"), slow=OVER.format("9-14")),
    Smoke("checkpoint.peer_throughput", r"memcpy \(one core\)\s+best"),
    Smoke("checkpoint.checkpoint_gpu", rf"checkpoint_gpu: {NO_CUDA}|x D2H pinned",
          ("--json", "{tmp}/g.json")),
    Smoke("restart.nccl_abort", rf"nccl_abort: {NO_CUDA}|woken: median"),
    Smoke("restart.cuda_standby_probe", rf"cuda_standby_probe: {NO_CUDA}|MEDIAN ranks=1"),
    Smoke("restart.compile_restart_probe", rf"compile_restart_probe: {NO_CUDA}|MEDIAN fresh"),
    Smoke("placement.numa_check", rf"numa_check: {NO_CUDA}(.|\n)*core-complex: exit 2"),
    Smoke("restart.forkserver", r"server ready after start", slow=OVER.format("8-9")),
    Smoke("goodput.stall", r"save\(\) median .* taken \d+ of"),
    Smoke("goodput.goodput", r"setting\s+goodput\s+fault", timeout=120),
    Smoke("goodput.model", r"setting\s+lost s per fault"),
    Smoke("goodput.copy_probe", rf"copy_probe: {NO_CUDA}|device-to-host GB/s"),
    Smoke("rendezvous.rendezvous_scale", r"\| impl \| store \| N \|(.|\n)*\| barrier \| etcd \| 8 ",
          ("--backend", "both", "--impl", "barrier"), timeout=120, needs="etcd"),
    # whole jobs: beyond the budget
    Smoke("monitor.live_view", r"### Step time under ft_launcher", ("--parts", "steps"),
          slow=A_JOB),
    Smoke("monitor.rerun", r"\| case \| rejected step -> verdict", ("--cases", "1"), slow=A_JOB),
    Smoke("monitor.lightning_overhead", r"\| variant \| median step", timeout=240, slow=A_JOB),
    Smoke("restart.compare", r"start-up: launch -> all ranks stepping", ("--json", "{tmp}/r.json"),
          timeout=180, slow=A_JOB),
    Smoke("restart.spares", r"launcher\s+loss -> stepping", timeout=180, slow=A_JOB),
    Smoke("restart.store_restart", r"launcher\s+cold start\s+store back",
          ("--json", "{tmp}/s.json"), timeout=240, slow=A_JOB),
    Smoke("restart.gpu_compare", r"gpu_compare: no CUDA here|startup", ("--out-dir", "{tmp}"),
          timeout=300, slow=A_JOB),
    Smoke("checkpoint.replication", r"MiB/rank\s+memcpy s\s+stall s", timeout=180, slow=A_JOB),
    Smoke("checkpoint.ettr", r"setting\s+save stall s", timeout=300, slow=A_JOB),
    Smoke("rendezvous.store_requests", r"\| store \| runs \| requests/s per agent \|", timeout=300,
          slow=A_JOB, needs="etcd"),
    Smoke("compat.nvrx_examples", r"nvrx_examples: no NVRx examples|of 1 passed",
          ("--set", "cpu", "--work", "{tmp}/work"), timeout=180, slow=A_JOB),
    Smoke("restart.inprocess_compare", r"ftrun-inprocess\s+0\.\d+",
          ("--contenders", "ftrun-inprocess", "--out-dir", "{tmp}"), timeout=300, slow=A_JOB),
    Smoke("compat.nvrx_inprocess",
          r"nvrx_inprocess: no NVRx examples|advanced_example.py\s+torchrun", timeout=300,
          slow=A_JOB),
]


def _param(smoke: Smoke) -> object:
    marks = []
    if smoke.slow and not ALL:
        marks.append(pytest.mark.skip(reason=f"{smoke.slow} (FTRUN_BENCH_SMOKE=all runs it)"))
    words = [a for a in smoke.args if not a.startswith(("-", "{"))]
    name = smoke.module + (f":{','.join(words)}" if words else "")
    return pytest.param(smoke, id=name, marks=marks)


def _present(program: str) -> bool:
    return bool(shutil.which(program) or os.access(f"/usr/bin/{program}", os.X_OK))


@pytest.mark.parametrize("smoke", [_param(s) for s in SMOKES])
def test_bench_smoke(smoke: Smoke, tmp_path: Path) -> None:
    if smoke.needs and not _present(smoke.needs):
        pytest.skip(f"no {smoke.needs} here (tests/etcd/install-etcd.sh installs it)")
    args = [a.format(tmp=tmp_path) for a in smoke.args]
    argv = [sys.executable, "-m", f"bench.{smoke.module}", "--smoke", *args]
    # A bench that overruns is killed by `run`; anything it started is re-parented to pytest
    # (a subreaper) and killed by the suite's no_leftover_processes fixture, which fails the test.
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=smoke.timeout,
                          check=False)  # fmt: skip
    said = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, said
    assert re.search(smoke.expect, done.stdout), said


def test_every_bench_has_a_smoke() -> None:
    """A new bench gets its line above (or fails here): every script with a `main`."""
    benches = {
        f"{path.parent.name}.{path.stem}"
        for path in (ROOT / "bench").glob("*/*.py")
        if path.parent.name not in {"common", "workers"} and "def main(" in path.read_text()
    }
    assert benches == {s.module for s in SMOKES}
