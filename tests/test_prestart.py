"""The prestarted workers' decisions (ftrun.agent.prewarm.prestart), without processes: which
held worker a start may use, the refill, and the option; the processes themselves are in
tests/test_forkserver.py and tests/test_prewarm_cycles.py."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import types
from collections.abc import Mapping
from pathlib import Path

import pytest

from ftrun.agent.prewarm import marks
from ftrun.agent.prewarm.prestart import PRELOAD_ON_COMPILE, HeldWorker, PrestartPool
from ftrun.agent.prewarm.wire import HEADER, PROTOCOL_VERSION, TO_CHILD, decode
from ftrun.agent.worker_env import PER_CYCLE, worker_envs
from ftrun.ft_launcher.build import build_config
from ftrun.rendezvous.ranks import NodeDescriptor, Round
from support import wait_for

BASE = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1", "FTRUN_CYCLE": "0"}


@dataclasses.dataclass
class FakeWorker:
    """A held worker's process as `HeldWorker.fits` asks it: alive or exited."""

    pid: int
    alive: bool = True
    returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = None if self.alive else 1
        return self.returncode


@dataclasses.dataclass
class FakeHeld(HeldWorker):
    """The real rule (`fits`) and gate writes; `discard` only notes it (no process to kill,
    and the gate is the test's to close)."""

    discarded: bool = False

    def discard(self) -> None:
        self.discarded = True

    def _close_gate(self) -> None:
        self._gate_open = False


class Forks:
    def __init__(self) -> None:
        self.made: list[tuple[dict[str, str], int]] = []
        self.fail = False
        self.gate = -1  # the held workers' gate (a real pipe's write end where a test reads it)

    def __call__(self, env: Mapping[str, str], device: int) -> FakeHeld:
        if self.fail:
            raise OSError("the fork server is gone")
        self.made.append((dict(env), device))
        return FakeHeld(FakeWorker(1000 + len(self.made)), self.gate, dict(env))


def env_of(local_rank: int, **more: str) -> dict[str, str]:
    return {**BASE, "LOCAL_RANK": str(local_rank), **more}


def filled(forks: Forks, ranks: int) -> PrestartPool:
    pool = PrestartPool(forks, delay=0.0)  # type: ignore[arg-type]
    for local_rank in range(ranks):
        pool.remember(env_of(local_rank))
    pool.refill_later()
    wait_for(lambda: len(pool.pids()) == ranks, 10, "the pool to fill")
    return pool


def test_each_local_rank_gets_one_on_its_own_gpu_and_a_start_takes_it() -> None:
    forks = Forks()
    pool = filled(forks, 2)
    assert [device for _, device in forks.made] == [0, 1]
    held = pool.take(env_of(1, FTRUN_CYCLE="1", RANK="3", MASTER_PORT="29501"))
    assert held is not None and held.env["LOCAL_RANK"] == "1"
    assert pool.take(env_of(1, FTRUN_CYCLE="1")) is None  # taken once
    assert len(pool.pids()) == 1
    pool.close()


def test_a_held_worker_that_cannot_run_the_new_environment_is_discarded() -> None:
    """Anything read before the script (CUDA's variables, say) must be what it was made with."""
    forks = Forks()
    pool = filled(forks, 2)
    first = pool._held["0"]  # type: ignore[attr-defined]
    assert pool.take(env_of(0, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")) is None
    assert first.discarded
    second = pool._held["1"]  # type: ignore[attr-defined]
    second.worker.alive = False
    assert pool.take(env_of(1)) is None and second.discarded
    pool.close()


def test_refill_makes_only_what_is_missing_and_a_failure_is_no_error() -> None:
    forks = Forks()
    pool = filled(forks, 2)
    pool.take(env_of(0, FTRUN_CYCLE="1"))
    pool.remember(env_of(0, FTRUN_CYCLE="1"))
    pool.refill_later()
    wait_for(lambda: len(forks.made) == 3, 10, "the missing worker")
    assert forks.made[-1][0]["FTRUN_CYCLE"] == "1"  # made with the cycle's latest environment
    pool.take(env_of(1))
    forks.fail = True
    pool.refill_later()  # logs, makes nothing, raises nothing
    pool.close()
    assert pool.pids() == frozenset()


def test_close_discards_every_held_worker_and_stops_a_waiting_refill() -> None:
    forks = Forks()
    pool = filled(forks, 2)
    held = list(pool._held.values())  # type: ignore[attr-defined]
    slow = PrestartPool(forks, delay=60.0)  # type: ignore[arg-type]
    slow.remember(env_of(0))
    slow.refill_later()
    pool.close()
    slow.close()
    assert all(h.discarded for h in held)
    before = threading.active_count()
    wait_for(lambda: threading.active_count() <= before, 10, "the refill threads to end")
    assert len(forks.made) == 2


def test_two_cycles_of_a_rank_differ_only_in_the_per_cycle_variables(tmp_path: Path) -> None:
    """What a prestarted worker is allowed to differ in, held to what the agent changes."""
    config = build_config(["--nproc-per-node=2", "--ft-prestart-workers=on", "x"], {})
    assert config.agent.prestart_workers
    nodes = (NodeDescriptor("n0", "127.0.0.1", 2, 29500), NodeDescriptor("n1", "h", 2, 29501))
    before = worker_envs(config, BASE, {"FTRUN_INPROCESS_PREFIX": "p/0"},
                         Round(0, nodes, 0), "n0", tmp_path / "c0")  # fmt: skip
    after = worker_envs(config, BASE, {"FTRUN_INPROCESS_PREFIX": "p/3"},
                        Round(3, nodes[::-1], 1), "n0", tmp_path / "c3")  # fmt: skip
    for old, new in zip(before, after, strict=True):
        changed = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
        assert changed and changed <= PER_CYCLE, changed - PER_CYCLE
    assert "LOCAL_RANK" not in PER_CYCLE and "CUDA_VISIBLE_DEVICES" not in PER_CYCLE


@pytest.mark.parametrize(("devices", "visible", "on"), [
    (2, None, True), (0, None, False), (2, "", False), (None, None, False),
])  # fmt: skip
def test_auto_is_on_where_nvml_sees_a_visible_gpu(
    fake_nvml: pytest.MonkeyPatch, devices: int | None, visible: str | None, on: bool
) -> None:
    if devices is None:
        fake_nvml.delenv("FAKE_NVML", raising=False)
    else:
        fake_nvml.setenv("FAKE_NVML", json.dumps({"devices": devices}))
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert build_config(["x"], environ).agent.prestart_workers is on
    assert not build_config(["--ft-prestart-workers=off", "x"], environ).agent.prestart_workers


def test_held_workers_preload_inductor_once_the_job_compiles() -> None:
    """Watched from the refill on: before the job's first torch.compile nothing is preloaded;
    once seen, every held worker gets one "preload" frame, and later prestarts get it at once."""
    compiling = threading.Event()
    forks = Forks()
    pool = PrestartPool(forks, delay=0.0, compiles=lambda env: compiling.is_set(),
                        watch_period=0.01)  # fmt: skip
    reader, gate = os.pipe()
    forks.gate = gate
    for local_rank in range(2):
        pool.remember(env_of(local_rank))
    pool.refill_later()
    wait_for(lambda: len(pool.pids()) == 2, 10, "the pool to fill")
    held = dict(pool._held)  # type: ignore[attr-defined]
    assert not any(h.preloaded for h in held.values())
    compiling.set()
    wait_for(lambda: all(h.preloaded for h in held.values()), 10, "the preloads")
    frames = os.read(reader, 65536)  # both held workers' (the fakes share one gate)
    (size,) = HEADER.unpack_from(frames)
    assert len(frames) == 2 * (HEADER.size + size)
    assert decode(frames[HEADER.size : HEADER.size + size], TO_CHILD) == {
        "v": PROTOCOL_VERSION, "op": "preload", "modules": list(PRELOAD_ON_COMPILE),
    }  # fmt: skip
    held["0"].preload(PRELOAD_ON_COMPILE)  # once
    pool.take(env_of(0, FTRUN_CYCLE="1"))
    pool.refill_later()
    wait_for(lambda: len(forks.made) == 3, 10, "the successor")
    wait_for(lambda: pool._held["0"].preloaded, 10, "the successor's preload")  # type: ignore[attr-defined]
    pool.close()
    os.close(reader)
    os.close(gate)


def test_no_preload_for_a_job_that_does_not_compile_and_the_watch_ends_with_the_pool() -> None:
    looked = threading.Event()

    def compiles(env: Mapping[str, str]) -> bool:
        looked.set()
        return False

    forks = Forks()
    pool = PrestartPool(forks, delay=0.0, compiles=compiles, watch_period=0.01)  # type: ignore[arg-type]
    before = threading.active_count()
    pool.remember(env_of(0))
    pool.refill_later()
    wait_for(looked.is_set, 10, "the watch")
    assert not pool._held["0"].preloaded  # type: ignore[attr-defined]
    pool.close()
    wait_for(lambda: threading.active_count() <= before, 10, "the watch to end")


def test_a_workers_first_torch_compile_flags_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`marks.install` wraps torch.compile: its first call creates the job's flag, returns what
    torch's returns, and puts torch's function back."""
    calls: list[object] = []

    def compile_(model: object = None, **kwargs: object) -> object:
        calls.append(model)
        return ("compiled", model)

    torch = types.ModuleType("torch")
    torch.compile = compile_  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    env = {"FTRUN_IPC_DIR": str(tmp_path)}
    marks.install(env)
    assert not marks.compiles_seen(env)
    assert torch.compile("m") == ("compiled", "m")  # type: ignore[attr-defined]
    assert marks.compiles_seen(env) and torch.compile is compile_  # type: ignore[attr-defined]
    assert calls == ["m"]
    assert not marks.compiles_seen({})
