"""`AsyncCallsQueue`: order, errors reaching the trainer, timeouts, aborts that publish nothing,
and two gloo ranks agreeing on what is done (a slow rank holds finalization back; a failing
rank makes both raise). Every thread a test starts is gone when it ends.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from ftrun.checkpointing import (
    AsyncCallError,
    AsyncCallsQueue,
    AsyncCallTimeoutError,
    AsyncRequest,
    CheckpointError,
    CheckpointUsageError,
)
from ftrun.checkpointing.async_progress import NONE, Decision, Progress, decide
from support import run_gloo_ranks, wait_for

WAIT_S = 10


pytestmark = pytest.mark.usefixtures("no_leftover_threads")


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event async fns wait on; released at teardown, so no worker outlives the test."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def queues() -> Iterator[Callable[..., AsyncCallsQueue]]:
    made: list[AsyncCallsQueue] = []

    def make(**kwargs: Any) -> AsyncCallsQueue:
        made.append(AsyncCallsQueue(**kwargs))
        return made[-1]

    yield make
    for queue in made:
        queue.close(abort=True)  # a no-op for those the test closed


def poll_finalize(queue: AsyncCallsQueue) -> list[int]:
    """Non-blocking `maybe_finalize_async_calls` until it finalizes something (or raises)."""
    deadline = time.monotonic() + WAIT_S
    while not (done := queue.maybe_finalize_async_calls()):
        assert time.monotonic() < deadline, "nothing was finalized"
        time.sleep(0.005)
    return done


def test_calls_finalize_in_order(queues: Callable[..., AsyncCallsQueue]) -> None:
    queue, ran, finalized = queues(), [], []
    for i in range(3):
        request = AsyncRequest(ran.append, (i,), [lambda i=i: finalized.append(i)])
        assert queue.schedule_async_request(request) == i
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1, 2]
    assert ran == finalized == [0, 1, 2]
    assert queue.get_num_unfinalized_calls() == 0
    queue.close()


def test_a_call_done_early_waits_for_the_one_before(
    queues: Callable[..., AsyncCallsQueue], gate: threading.Event
) -> None:
    queue, finalized, second_ran = queues(persistent=False), [], threading.Event()
    queue.schedule_async_request(AsyncRequest(gate.wait, (WAIT_S,), [lambda: finalized.append(0)]))
    queue.schedule_async_request(AsyncRequest(second_ran.set, (), [lambda: finalized.append(1)]))
    assert second_ran.wait(WAIT_S)
    assert queue.maybe_finalize_async_calls() == []
    assert queue.get_num_unfinalized_calls() == 2
    gate.set()
    assert poll_finalize(queue) == [0, 1]
    assert finalized == [0, 1]
    queue.close()


def failing_write(message: str) -> None:
    raise OSError(message)


def test_an_error_in_the_async_fn_is_raised_in_the_trainer(
    queues: Callable[..., AsyncCallsQueue],
) -> None:
    queue, finalized = queues(), []
    request = AsyncRequest(
        failing_write, ("No space left\non device",), [lambda: finalized.append(0)]
    )
    queue.schedule_async_request(request)
    queue.schedule_async_request(AsyncRequest(time.sleep, (0,), [lambda: finalized.append(1)]))
    with pytest.raises(AsyncCallError, match=r"^async call 0 failed: OSError: No space left$") as e:
        poll_finalize(queue)
    assert isinstance(e.value, CheckpointError)
    assert isinstance(e.value.__cause__, OSError)
    assert e.value.call_idx == 0
    # The failed call is dropped, never finalized; the calls after it go on.
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    assert finalized == [1]
    queue.close()


def test_a_stuck_call_times_out(
    queues: Callable[..., AsyncCallsQueue], gate: threading.Event
) -> None:
    queue, finalized = queues(timeout=0.2), []
    queue.schedule_async_request(AsyncRequest(gate.wait, (WAIT_S,), [lambda: finalized.append(0)]))
    start = time.monotonic()
    with pytest.raises(AsyncCallTimeoutError, match="async call 0 still running here after the"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert 0.2 <= time.monotonic() - start < 2
    # Abandoned: the next call is not stuck behind it (a hung global directory's save).
    assert queue.get_num_unfinalized_calls() == 0
    queue.schedule_async_request(AsyncRequest(time.sleep, (0,), [lambda: finalized.append(1)]))
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    start = time.monotonic()
    queue.close(abort=True)
    assert time.monotonic() - start < 1  # abort waits for nothing
    gate.set()  # the fn returns; its result is dropped
    assert finalized == [1]


def test_abort_publishes_nothing_and_runs_no_finalize(
    queues: Callable[..., AsyncCallsQueue], gate: threading.Event, tmp_path: Path
) -> None:
    """The finalize is what makes a checkpoint visible (rename into place): an abort skips it."""
    queue, finalized, ran = queues(), [], []
    writing = threading.Event()

    def write(name: str, slow: bool) -> None:
        ran.append(name)
        temp = tmp_path / f"{name}.tmp"
        temp.mkdir()
        (temp / "part").write_bytes(b"x" * 1024)
        if slow:
            writing.set()
            gate.wait(WAIT_S)

    def publish(name: str) -> Callable[[], None]:
        def rename() -> None:
            os.rename(tmp_path / f"{name}.tmp", tmp_path / name)
            finalized.append(name)

        return rename

    for name, slow in (("done", False), ("slow", True), ("queued", False)):
        queue.schedule_async_request(AsyncRequest(write, (name, slow), [publish(name)]))
    assert writing.wait(WAIT_S)  # "done" is written (not finalized), "slow" is being written
    start = time.monotonic()
    queue.close(abort=True)
    assert time.monotonic() - start < 1  # abort waits for nothing
    gate.set()
    wait_for(
        lambda: not any(t.name.startswith("ftrun-async") for t in threading.enumerate()),
        timeout=WAIT_S,
        what="the worker to exit",
    )
    assert finalized == []
    assert ran == ["done", "slow"]  # the queued call never started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.tmp", "slow.tmp"]
    assert queue.maybe_finalize_async_calls(blocking=True) == []
    with pytest.raises(CheckpointUsageError, match="closed"):
        queue.schedule_async_request(AsyncRequest(None, (), []))


def test_preload_runs_in_the_trainer_and_its_error_propagates_at_once(
    queues: Callable[..., AsyncCallsQueue],
) -> None:
    queue, seen = queues(), []
    main = threading.current_thread()

    def preload() -> str:
        assert threading.current_thread() is main
        return "staged"

    queue.schedule_async_request(
        AsyncRequest(lambda *args: seen.append(args), ("a", "live", "c"), [], preload_fn=preload)
    )
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert seen == [("a", "staged", "c")]

    def broken_preload() -> None:
        raise RuntimeError("CUDA error: out of memory")

    request = AsyncRequest(seen.append, ("a", "b"), [], preload_fn=broken_preload)
    with pytest.raises(RuntimeError, match="out of memory") as raised:
        queue.schedule_async_request(request)
    # The index is used (ranks stay aligned) and the call settles as failed, on every rank.
    assert queue.get_num_unfinalized_calls() == 1
    with pytest.raises(AsyncCallError, match="async call 1 failed: RuntimeError") as e:
        queue.maybe_finalize_async_calls()
    assert e.value.__cause__ is raised.value
    queue.close()


def test_a_noop_request_after_a_real_one_is_finalized(
    queues: Callable[..., AsyncCallsQueue],
) -> None:
    """NVRx's persistent caller waits forever for a no-op request scheduled after a real one."""
    queue, finalized = queues(), []
    queue.schedule_async_request(AsyncRequest(time.sleep, (0,), [lambda: finalized.append(0)]))
    queue.schedule_async_request(AsyncRequest(time.sleep, (0,), [lambda: finalized.append(1)]))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    queue.close()


def test_close_settles_every_call_then_raises_the_first_failure(
    queues: Callable[..., AsyncCallsQueue],
) -> None:
    queue, finalized = queues(), []
    queue.schedule_async_request(AsyncRequest(failing_write, ("disk gone",), []))
    queue.schedule_async_request(AsyncRequest(time.sleep, (0.05,), [lambda: finalized.append(1)]))
    with pytest.raises(AsyncCallError, match="async call 0 failed: OSError: disk gone"):
        queue.close()
    assert finalized == [1]
    assert queue.get_num_unfinalized_calls() == 0


def test_a_finalize_fn_error_propagates_unchanged(queues: Callable[..., AsyncCallsQueue]) -> None:
    queue = queues()
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: failing_write("rename")]))
    with pytest.raises(OSError, match="rename"):
        queue.maybe_finalize_async_calls()
    assert queue.get_num_unfinalized_calls() == 0
    queue.close()


class OtherRequest(NamedTuple):  # like Megatron's own AsyncRequest
    async_fn: Any
    async_fn_args: tuple
    finalize_fns: list
    preload_fn: Any = None


def test_requests_freeze_and_convert(queues: Callable[..., AsyncCallsQueue]) -> None:
    request = AsyncRequest(None, (), [])
    frozen = request.freeze()
    request.add_finalize_fn(lambda: None)
    assert frozen.is_frozen and frozen.finalize_fns == []
    with pytest.raises(CheckpointUsageError, match="frozen"):
        frozen.add_finalize_fn(lambda: None)
    queue, finalized = queues(), []
    queue.schedule_async_request(OtherRequest(None, (), [lambda: finalized.append(0)]))
    assert queue.maybe_finalize_async_calls(no_dist=True) == [0] and finalized == [0]
    with pytest.raises(CheckpointUsageError, match="not an AsyncRequest"):
        queue.schedule_async_request(("fn", ()))  # type: ignore[arg-type]
    with pytest.raises(CheckpointUsageError, match="preload_fn"):
        queue.schedule_async_request(AsyncRequest(print, ("a",), [], preload_fn=lambda: 1))
    with pytest.raises(CheckpointUsageError, match="timeout"):
        AsyncCallsQueue(timeout=0)
    queue.close()


def test_execute_sync_runs_everything_here() -> None:
    seen: list[Any] = []
    request = AsyncRequest(seen.append, ("x", "y"), [lambda: seen.append("fin")])
    request._replace(preload_fn=lambda: "staged", async_fn=lambda *a: seen.append(a)).execute_sync()
    assert seen == [("x", "staged"), "fin"]
    with pytest.raises(AsyncCallError, match="async call 0 failed: OSError: full"):
        AsyncRequest(failing_write, ("full",), [lambda: seen.append("no")]).execute_sync()
    assert seen[-1] == "fin"


def progress(done: int, failed: int = NONE, timed_out: int = NONE, last: int = 3) -> Progress:
    return Progress(done, failed, timed_out, last, -last)


@pytest.mark.parametrize(
    ("agreed", "decision"),
    [
        (progress(3), Decision(3)),
        (progress(0), Decision(0)),  # 1 is still running somewhere
        (progress(0, failed=1), Decision(0, failed=1)),
        (progress(0, failed=2), Decision(0)),  # 2 failed, but 1 is not done yet: in order
        (progress(1, timed_out=2), Decision(1, timed_out=2)),
        (progress(1, failed=2, timed_out=3), Decision(1, failed=2)),
        (Progress(3, NONE, NONE, 2, -3), Decision(-1, mismatch=(2, 3))),
    ],
)
def test_decide(agreed: Progress, decision: Decision) -> None:
    assert decide(agreed) == decision


TWO_RANKS = r"""
import datetime, json, os, sys, threading, time
import torch.distributed as dist
from ftrun.checkpointing import AsyncCallError, AsyncCallsQueue, AsyncCallTimeoutError, AsyncRequest

root, rank = sys.argv[1], int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
collectives, all_reduce = [0], dist.all_reduce
def counting(*args, **kwargs):
    collectives[0] += 1
    return all_reduce(*args, **kwargs)
dist.all_reduce = counting

def wait_file(path):
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        assert time.monotonic() < deadline, path
        time.sleep(0.01)

out, finalized, written = {}, [], threading.Event()
def write():  # rank 1's write is the slow one: it waits for rank 0's go-ahead
    if rank == 1:
        wait_file(os.path.join(root, "go"))
    open(os.path.join(root, f"rank{rank}"), "w").close()
    written.set()

queue = AsyncCallsQueue(timeout=20)
queue.schedule_async_request(AsyncRequest(write, (), [
    lambda: finalized.append(sorted(os.listdir(root)))]))
if rank == 0:
    assert written.wait(20)  # this rank's write is done, rank 1's is not
out["early"] = [queue.maybe_finalize_async_calls() for _ in range(3)]
out["collectives"] = collectives[0]
if rank == 0:
    open(os.path.join(root, "go"), "w").close()
while not (done := queue.maybe_finalize_async_calls()):
    time.sleep(0.01)
out["done"], out["finalized"] = done, list(finalized)

def fail_on_rank_1():
    if rank == 1:
        raise OSError("No space left on device")
queue.schedule_async_request(AsyncRequest(fail_on_rank_1, (), [lambda: finalized.append(1)]))
try:
    queue.maybe_finalize_async_calls(blocking=True)
except AsyncCallError as e:
    out["failure"] = [str(e), repr(e.__cause__)]

stuck = threading.Event()
hangs = AsyncCallsQueue(timeout=0.5)
hangs.schedule_async_request(AsyncRequest(lambda: rank != 0 or stuck.wait(20), (), [
    lambda: finalized.append(2)]))
start = time.monotonic()
try:
    hangs.maybe_finalize_async_calls(blocking=True)
except AsyncCallTimeoutError as e:
    out["timeout"] = [str(e), time.monotonic() - start < 5]
hangs.close(abort=True)
stuck.set()
queue.close()
dist.destroy_process_group()
for thread in threading.enumerate():
    if thread is not threading.main_thread() and thread.name.startswith("ftrun-async"):
        thread.join(5)
out["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("ftrun-async")]
out["finalized_at_end"] = len(finalized)
print(json.dumps(out))
"""


def test_two_gloo_ranks_finalize_together_and_fail_together(tmp_path: Path) -> None:
    lines = run_gloo_ranks(TWO_RANKS, [str(tmp_path)], timeout=60)
    results = [json.loads(line) for line in lines]
    for rank, result in enumerate(results):
        # Rank 0's write was done, rank 1's not: nothing finalized, one all_reduce per check.
        assert result["early"] == [[], [], []]
        assert result["collectives"] == 3
        # Finalized on both once rank 1 was done (its part was there when the finalize ran).
        assert result["done"] == [0]
        assert result["finalized"] == [["go", "rank0", "rank1"]]
        message, cause = result["failure"]
        if rank == 1:
            assert message == "async call 1 failed: OSError: No space left on device"
            assert cause.startswith("OSError(")
        else:
            assert message == "async call 1 failed on another rank"
            assert cause == "None"
        where = "here" if rank == 0 else "on another rank"
        assert result["timeout"] == [
            f"async call 0 still running {where} after the 0.5 s timeout: abandoned, "
            "the next call runs on a new worker",
            True,
        ]
        assert result["threads"] == []
        assert result["finalized_at_end"] == 1  # neither the failed nor the stuck call
