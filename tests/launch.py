"""Running several `ft_launcher` "nodes" on 127.0.0.1 for process-level tests."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from support import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_ddp.py"
KILL_DEADLINE_S = 10


@dataclasses.dataclass
class Node:
    index: int
    proc: subprocess.Popen[bytes]
    output: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace")


@dataclasses.dataclass
class Job:
    """Launchers of one job; `log_dir` holds their events and worker logs."""

    tmp: Path
    nodes: list[Node]
    log_dir: Path
    ckpt_dir: Path
    argv: list[str]

    def add_node(self, index: int, env: dict[str, str] | None = None) -> Node:
        """Start one more launcher of this job (a replacement node joining later)."""
        node = _start_launcher(self.tmp, index, self.argv, env or {})
        self.nodes.append(node)
        return node

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for node in self.nodes:
            try:
                codes.append(node.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                where = "\n".join(_blocked_in(n.proc.pid) for n in self.nodes)
                self.kill()
                raise AssertionError(
                    f"launcher {node.index} still running after {timeout}s:\n{node.text()[-3000:]}"
                    f"\nwhere each process of the job waited:\n{where}"
                ) from None
        return codes

    def kill(self) -> None:
        """SIGKILL every launcher still running (its process group) and reap it."""
        running = [node for node in self.nodes if node.proc.poll() is None]
        for node in running:
            os.killpg(node.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_DEADLINE_S
        stuck = []
        for node in running:
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stuck.append(node.index)
        assert not stuck, f"launchers {stuck} alive {KILL_DEADLINE_S}s after SIGKILL"

    def events(self, name: str | None = None) -> list[dict]:
        found = []
        for path in sorted(self.log_dir.glob("events-*.jsonl")):
            found += [json.loads(line) for line in path.read_text().splitlines()]
        return [e for e in found if name is None or e["event"] == name]

    def wait_event(self, name: str, count: int = 1, timeout: float = 60) -> list[dict]:
        return wait_for(
            lambda: (found := self.events(name)) and len(found) >= count and found,
            timeout,
            f"{count} {name!r} event(s)",
        )

    def report(self) -> str:
        """`ftrun report --no-timeline` of this job's log directory, as text."""
        return subprocess.run(
            [sys.executable, "-m", "ftrun.tools.cli", "report", "--no-timeline",
             str(self.log_dir)], capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip

    def failures(self) -> list[dict]:
        """The lines of `<log-dir>/failures.jsonl` (the named failures of every node)."""
        path = self.log_dir / "failures.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]

    def progress(self, rank: int) -> list[tuple[int, int]]:
        path = self.ckpt_dir / f"progress-rank{rank}.txt"
        if not path.exists():
            return []
        rows = [line.split() for line in path.read_text().splitlines()]
        return [(int(cycle), int(step)) for cycle, step, _ in rows]


def start_job(
    tmp: Path,
    nodes: int,
    launcher_args: Sequence[str],
    script_args: Sequence[str] = (),
    script: Path = EXAMPLE,
    nproc: int = 1,
    node_env: Sequence[dict[str, str]] | None = None,
    order: Sequence[int] | None = None,
    endpoint: str | None = None,
    wrap: Sequence[str] = (),
) -> Job:
    """Start `nodes` launchers (in `order`) for one job on a fresh rendezvous port (or at
    `endpoint`: a store the test serves); `wrap`: a command each launcher runs under, which
    execs it (its pid stays the launcher's)."""
    log_dir, ckpt_dir = tmp / "logs", tmp / "ckpt"
    endpoint = endpoint or f"127.0.0.1:{free_port()}"
    launcher_args = [*launcher_args, *prewarm_args(launcher_args, script)]
    common = [
        f"--nnodes={nodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id=test-{tmp.name}",
        f"--log-dir={log_dir}",
        "--monitor-interval=0.1",
        *launcher_args,
    ]
    argv = [*common, str(script), "--ckpt-dir", str(ckpt_dir), *script_args]
    started = [
        _start_launcher(tmp, index, argv, node_env[index] if node_env else {}, wrap)
        for index in (order or range(nodes))
    ]
    return Job(tmp, sorted(started, key=lambda n: n.index), log_dir, ckpt_dir, argv)


def snapshot_rows(job: Job, rank: int) -> list[tuple[str, int, int, str]]:
    """The lines `tests/workers/snapshot_worker.py` wrote for `rank`: (kind, cycle, step,
    digest), kind "resumed" or "step"."""
    path = job.ckpt_dir / f"rank{rank}.log"
    text = path.read_text() if path.exists() else ""
    return [(kind, int(c), int(s), d) for kind, c, s, d in map(str.split, text.splitlines())]


def prewarm_args(launcher_args: Sequence[str], script: Path) -> list[str]:
    """The fork server's imports for a test job, where the test does not choose them.

    On 2 cores and 3 xdist workers, each CPU second a job spends is taken from another job
    under test, so the fork server imports what its workers will, once a node, and no more:
    - no deep warm-up after the first cycle (torch._dynamo, about 1.3 s of CPU a node):
      tests/test_prewarm_cycles.py and the demo test it;
    - a script that builds DistributedDataParallel or an optimizer (each imports torch._dynamo,
      about 1.4 s of CPU) gets it before the first fork, instead of in every worker of every
      cycle;
    - a script that never imports torch gets a server that does not either (about 1.6 s a node).
    The fork-server path is the same; only the modules it imports change."""

    def given(flag: str) -> bool:
        return any(arg.startswith(flag) for arg in launcher_args)

    extra = [] if given("--ft-prewarm-deep-modules") else ["--ft-prewarm-deep-modules=none"]
    if given("--ft-prewarm-modules"):
        return extra
    text = script.read_text()
    if re.search(r"^\s*(import|from) torch\b", text, re.MULTILINE) is None:
        return [*extra, "--ft-prewarm-modules=ftrun.client_lib"]
    if "DistributedDataParallel" in text or "torch.optim." in text:
        return [*extra, "--ft-prewarm-modules=torch,torch.distributed,torch._dynamo"]
    return extra


def _start_launcher(
    tmp: Path, index: int, argv: list[str], extra_env: dict[str, str], wrap: Sequence[str] = ()
) -> Node:
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"}
    output = tmp / f"launcher{index}.log"
    with output.open("wb") as out:
        proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "ftrun.ft_launcher.cli", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return Node(index, proc, output)


def node_of(job: Job, event_node: str) -> Node:
    """The launcher whose events carry `event_node` (named host-pid when not under Slurm)."""
    return next(n for n in job.nodes if event_node.endswith(f"-{n.proc.pid}"))


def _blocked_in(pid: int) -> str:
    """Each process of a launcher's tree: pid, state, the kernel function it sleeps in and its
    command line (what a job that does not end is waiting for)."""
    import psutil

    lines = []
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error, OSError):
                wchan = Path(f"/proc/{proc.pid}/wchan").read_text()
                cmd = " ".join(proc.cmdline())[:120]
                lines.append(f"  {proc.pid} {proc.status()} {wchan or '-'} {cmd}")
    return "\n".join(lines)
