"""Failure signatures from real failures' stderr (tests/data/failures: made on this VM and, for
the CUDA and NCCL ones, on the GPU device by make_gpu_fixtures.sh)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ftrun.agent.decisions.attribution import (
    Kind,
    collective_signature,
    exit_signature,
    hang_cause,
    hang_signature,
    last_exception,
)
from ftrun.rank_monitor.stacks import where_stuck

FIXTURES = Path(__file__).parent / "data" / "failures"


def fixture(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


@pytest.mark.parametrize(
    ("name", "code", "kind", "detail", "where", "secondary"),
    [
        ("python_exception", 1, Kind.EXCEPTION, "json.decoder.JSONDecodeError",
         "exc.py:3 in load", False),
        ("sigsegv", -signal.SIGSEGV, Kind.SIGNAL, "SIGSEGV", "segv.py:4 in step", False),
        ("gloo_peer_lost", 1, Kind.PEER_LOST, "RuntimeError", "", True),
        ("cuda_oom", 1, Kind.CUDA, "CUDA out of memory", "", False),
        ("device_assert", 1, Kind.CUDA, "CUDA error: device-side assert triggered", "", False),
        ("illegal_memory_access", 1, Kind.CUDA,
         "CUDA error: an illegal memory access was encountered", "", False),
        ("nccl_duplicate_gpu", 1, Kind.NCCL, "NCCL error: invalid usage", "", False),
    ],
)  # fmt: skip
def test_signature_of_a_real_failure(
    name: str, code: int, kind: str, detail: str, where: str, secondary: bool
) -> None:
    if not (FIXTURES / f"{name}.txt").exists():
        pytest.skip(f"{name}.txt: make it on a GPU machine with make_gpu_fixtures.sh")
    found = exit_signature(code, fixture(name))
    assert (found.kind, found.detail, found.where, found.secondary) == (
        kind, detail, where, secondary,
    )  # fmt: skip


def test_the_message_is_evidence_not_identity() -> None:
    text = fixture("python_exception")
    other = text.replace("line 1 column 2 (char 1)", "line 9 column 7 (char 80)")
    first, second = exit_signature(1, text), exit_signature(1, other)
    assert first.key == second.key
    assert first.message != second.message
    assert "Expecting property name" in first.message


def test_a_cuda_oom_is_the_same_failure_wherever_it_surfaces() -> None:
    text = fixture("cuda_oom")
    moved = text.replace("line 3, in grow", "line 30, in grow")
    assert exit_signature(1, text).key == exit_signature(1, moved).key


def test_torch_rank_prefixes_are_read_through() -> None:
    prefixed = "".join(f"[rank3]: {line}\n" for line in fixture("python_exception").splitlines())
    assert exit_signature(1, prefixed) == exit_signature(1, fixture("python_exception"))


def test_sigkill_leaves_no_text_and_names_the_usual_suspects() -> None:
    found = exit_signature(-signal.SIGKILL, "")
    assert (found.kind, found.detail) == (Kind.SIGNAL, "SIGKILL")
    assert "OOM killer" in found.message


def test_a_plain_exit_code_keeps_the_last_line() -> None:
    found = exit_signature(3, "loading data\nshard 7 missing, giving up\n")
    assert found.key == "exit: exit code 3"
    assert found.message == "shard 7 missing, giving up"


def test_the_last_traceback_wins_and_a_truncated_one_is_none() -> None:
    two = (
        fixture("python_exception")
        + "\n"
        + fixture("python_exception").replace("json.decoder.JSONDecodeError", "KeyError")
    )
    assert exit_signature(1, two).detail == "KeyError"
    assert last_exception('Traceback (most recent call last):\n  File "a.py", line 1') is None


def test_a_hang_is_named_by_where_the_rank_was_stuck() -> None:
    stack = (
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
        "line 3252 in all_reduce\n"
        '  File "/job/train.py", line 40 in step\n'
        '  File "/job/train.py", line 90 in <module>\n'
    )
    found = hang_signature("heartbeat", None, where_stuck(stack))
    assert found.key == "hang: heartbeat at train.py:40 in step"
    assert "waiting inside" in found.message
    assert hang_signature("section", "step", None).message == "no stack dump"


WAITING = (
    "Current thread 0x00007f (most recent call first):\n"
    '  File "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
    "line 3252 in all_reduce\n"
    '  File "/job/train.py", line 40 in step\n'
)
OWN_CODE = (
    'Current thread 0x00007f (most recent call first):\n  File "/job/data.py", line 7 in load\n'
)


def test_a_stopped_rank_is_named_without_stacks_and_is_no_consequence() -> None:
    found = hang_signature("heartbeat", None, None, rank=3, stopped=True)
    assert found.key == "hang: heartbeat, process stopped"
    assert (found.rank, found.secondary, found.where) == (3, False, "")
    assert "SIGSTOP" in found.message


def test_the_cause_of_a_hang_a_stopped_rank_then_own_code_then_a_consequence() -> None:
    waiting = hang_signature("heartbeat", None, where_stuck(WAITING), rank=0)
    own = hang_signature("heartbeat", None, where_stuck(OWN_CODE), rank=1)
    stopped = hang_signature("heartbeat", None, None, rank=2, stopped=True)
    # Verdicts of one hang come in any order: the waiting ranks miss their heartbeats too.
    assert hang_cause([waiting, own, stopped]) == stopped
    assert hang_cause([waiting, own]) == own
    blamed = hang_cause([waiting, hang_signature("heartbeat", None, where_stuck(WAITING), rank=5)])
    assert (blamed.rank, blamed.secondary) == (0, True)


def test_a_skipped_collective_names_the_missing_ranks() -> None:
    found = collective_signature("all_reduce", 12, [3])
    assert found.key == "collective: all_reduce not entered"
    assert found.message == "seq 12, ranks 3"
