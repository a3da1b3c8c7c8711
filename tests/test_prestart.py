"""The prestarted workers' decisions (ftrun.agent.prewarm.prestart), without processes: which
held worker a start may use, the refill, and the option; the processes themselves are in
tests/test_forkserver.py and tests/test_prewarm_cycles.py."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest

from ftrun.agent.prewarm.prestart import HeldWorker, PrestartPool
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
    """The real rule (`fits`); `discard` only notes it (no process to kill)."""

    discarded: bool = False

    def discard(self) -> None:
        self.discarded = True


class Forks:
    def __init__(self) -> None:
        self.made: list[tuple[dict[str, str], int]] = []
        self.fail = False

    def __call__(self, env: Mapping[str, str], device: int) -> FakeHeld:
        if self.fail:
            raise OSError("the fork server is gone")
        self.made.append((dict(env), device))
        return FakeHeld(FakeWorker(1000 + len(self.made)), -1, dict(env))


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
