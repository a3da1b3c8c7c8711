"""A node agent with no process: the real `NodeAgent`, policy, rendezvous (on a c10d
`HashStore`), rank monitor and events, with fake workers and a fake termination.

    with running_agent(tmp_path, ["--max-restarts=1"]) as node:
        node.spawner.started(2)            # wait for the cycle's 2 workers
        node.spawner.workers[0].exit(1)    # a crash
        assert node.result(10) == ExitCode.FAILED

Workers are `FakeWorker`s: fake pids above the kernel's pid limit (no signal can reach a real
process), empty output, and an exit the test decides. Stopping them (`FakeTermination`) makes
each exit as the signal would. Everything the test starts is stopped at the end.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import queue
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from torch.distributed import HashStore, Store

from ftrun.agent.loop.inbox import SignalRecorder
from ftrun.agent.loop.node import NodeAgent
from ftrun.agent.loop.runtime import AgentRuntime
from ftrun.agent.node_services.inprocess_link import InprocessLink
from ftrun.agent.termination import Delivery, StopResult
from ftrun.agent.workers import SpawnPath
from ftrun.errors import ExitCode
from ftrun.eventlog.writer import EventLog
from ftrun.ft_launcher.build import build_config
from ftrun.rank_monitor import RankMonitorServer
from ftrun.services import NodeService, NodeServices

FAKE_PID_BASE = 1 << 30
"""Above PID_MAX_LIMIT (2**22): a fake pid never names a real process."""
_pids = itertools.count(FAKE_PID_BASE)


class FakeWorker:
    """`subprocess.Popen`'s shape, for `WorkerGroup`: it runs until `exit` is called."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.pid = next(_pids)
        self.env = dict(env)
        self.stdout = io.BytesIO()
        self.stderr = io.BytesIO()
        self.returncode: int | None = None
        self._ended = threading.Event()

    @property
    def rank(self) -> int:
        return int(self.env["RANK"])

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise TimeoutError(f"fake worker {self.pid} still running")
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


class FakeSpawner:
    """Starts `FakeWorker`s; `started(n)` waits until n workers in all have been started."""

    def __init__(self) -> None:
        self.workers: list[FakeWorker] = []
        self._cond = threading.Condition()

    def spawn(self, env: Mapping[str, str], announce: Callable[[int], None]) -> FakeWorker:
        worker = FakeWorker(env)
        announce(worker.pid)
        with self._cond:
            self.workers.append(worker)
            self._cond.notify_all()
        return worker

    def cycle_path(self) -> SpawnPath:
        return SpawnPath("spawned", "fake workers")

    def started(self, count: int, timeout: float = 10.0) -> list[FakeWorker]:
        """Wait until `count` workers in all (every cycle's) have been started; all of them."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.workers) >= count, timeout):
                raise AssertionError(f"{len(self.workers)} of {count} fake workers started")
            return list(self.workers)

    def by_pid(self, pid: int) -> FakeWorker | None:
        return next((w for w in self.workers if w.pid == pid), None)


class FakeTermination:
    """Stops fake workers as the signal would end real ones; records every call."""

    def __init__(self, spawner: FakeSpawner) -> None:
        self.spawner = spawner
        self.stops: list[tuple[list[int], Delivery]] = []
        self.killed: list[int] = []

    def terminate(
        self, leaders: list[int], delivery: Delivery, keep: frozenset[int] = frozenset()
    ) -> StopResult:
        self.stops.append((list(leaders), delivery))
        for pid in leaders:
            if (worker := self.spawner.by_pid(pid)) is not None:
                worker.exit(-delivery.first)
        return StopResult(0.0, 0, 0)

    def kill_now(self, pid: int) -> None:
        self.killed.append(pid)
        if (worker := self.spawner.by_pid(pid)) is not None:
            worker.exit(-signal.SIGKILL)


class RunningAgent:
    """One node agent running in a thread of this process."""

    def __init__(self, runtime: AgentRuntime, spawner: FakeSpawner) -> None:
        self.runtime = runtime
        self.spawner = spawner
        self.termination = FakeTermination(spawner)
        self.signals = SignalRecorder(runtime.inbox)
        self.agent = NodeAgent(runtime, self.signals, self.termination)
        self._code: ExitCode | None = None
        self._thread = threading.Thread(target=self._run, name="fake-node-agent", daemon=True)

    def _run(self) -> None:
        self._code = self.agent.run()

    def start(self) -> RunningAgent:
        self._thread.start()
        return self

    def post(self, item: object) -> None:
        """Put an item on the agent's inbox, as a watcher thread or the monitor would."""
        self.runtime.inbox.put(item)

    def signal(self, sig: signal.Signals) -> None:
        """The launcher receives `sig` (its handler only records it)."""
        self.signals(sig, None)

    def result(self, timeout: float = 20.0) -> ExitCode:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the agent did not exit in {timeout:g}s")
        assert self._code is not None
        return self._code

    def events(self, name: str | None = None) -> list[dict]:
        import json

        lines = self.runtime.events.path.read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        return [r for r in rows if name is None or r.get("event") == name]


@contextlib.contextmanager
def running_agent(
    tmp: Path,
    args: Sequence[str] = (),
    services: Sequence[NodeService] = (),
    store: Store | None = None,
) -> Iterator[RunningAgent]:
    """An agent of a one-node job with `--nproc-per-node=2` unless `args` say otherwise;
    `store`: the job's store (a fresh HashStore if none)."""
    config = build_config(
        ["--nnodes=1", "--nproc-per-node=2", "--monitor-interval=0.05",
         f"--log-dir={tmp / 'logs'}", "--rdzv-id=fake", *args, "train.py"], {},
    )  # fmt: skip
    (tmp / "logs" / "n0").mkdir(parents=True, exist_ok=True)
    events = EventLog(tmp / "logs", "n0")
    monitor = RankMonitorServer(config.monitor, tmp / "job").start()
    node_services = NodeServices()
    for service in services:
        node_services.add(service)
    spawner = FakeSpawner()
    store = store if store is not None else HashStore()
    runtime = AgentRuntime(
        config=config, environ={}, host="127.0.0.1", node="n0", node_log_dir=tmp / "logs" / "n0",
        events=events, inbox=queue.SimpleQueue(), store=store, is_store_host=True,
        infra_rank=None, services=node_services, monitor=monitor, spawner=spawner, peer_port=0,
        job_dir=tmp / "job", restore_peer=lambda: None, answers=lambda _d: True,
        inprocess=InprocessLink(store, config.agent, "fake", events.emit),
    )  # fmt: skip
    node = RunningAgent(runtime, spawner)
    try:
        yield node.start()
    finally:
        if node._thread.is_alive():
            node.signal(signal.SIGTERM)
            for worker in spawner.workers:
                worker.exit(-signal.SIGKILL)
            node._thread.join(20)
        node_services.close()
        monitor.stop()
        events.close()
