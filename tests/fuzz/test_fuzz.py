"""Every boundary in `targets` fed corrupted input (Hypothesis): the decoder returns a value or
raises one of its typed errors, within a bound of CPU time, never anything else.

`make test` runs each target at `FTRUN_FUZZ_EXAMPLES` inputs (default 300); `make fuzz` at
100,000 and writes each target's count of inputs and failures to `FTRUN_FUZZ_REPORT`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from fuzz.targets import TARGETS, Target, corrupt

EXAMPLES = int(os.environ.get("FTRUN_FUZZ_EXAMPLES", "300"))


# Hypothesis says so when it shows a failing input of 100 kB (the deep nesting seeds): a remark
# about its report, not the decoder's failure.
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_a_corrupt_input_is_a_typed_error_or_a_value(target: Target):
    tried = [0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(corrupt(target.seeds))
    def check(raw: bytes) -> None:
        tried[0] += 1
        # CPU time (a loop burns it, a busy machine does not), without the garbage collector's:
        # after 50,000 inputs a collection of Hypothesis's heap took 1.3 s inside a decode.
        gc.disable()
        try:
            started = time.thread_time()
            with contextlib.suppress(*target.allowed):
                target.decode(raw)
            took = time.thread_time() - started
        finally:
            gc.enable()
        assert took < target.slow_s, f"{target.name}: {took:.2f} s on {raw[:80]!r}"

    failed = True
    try:
        check()
        failed = False
    finally:
        _report(target.name, tried[0], failed)


def _report(name: str, tried: int, failed: bool) -> None:
    path = os.environ.get("FTRUN_FUZZ_REPORT")
    if path:
        with Path(path).open("a") as out:
            out.write(json.dumps({"target": name, "inputs": tried, "failures": int(failed)}))
            out.write("\n")


DEEP = b"[" * 100_000
REGRESSIONS = [  # what fuzzing found, each fixed: (target, the input that broke it)
    ("published rendezvous round", b""),  # zlib.error
    ("straggler node record", b"null"),  # AttributeError
    ("in-process interruption record", b"null"),  # AttributeError
    ("in-process interruption record", b'{"at": 1e999}'),  # an infinite time
    *((name, DEEP) for name in ("fork server, to the server", "events log line",  # RecursionError
                                "straggler node record", "a rank's progress report (store)",
                                "flight recorder dump", "--ft-cfg-path YAML")),
]  # fmt: skip


@pytest.mark.parametrize(("name", "raw"), REGRESSIONS, ids=[n for n, _ in REGRESSIONS])
def test_what_fuzzing_found_stays_fixed(name: str, raw: bytes):
    target = next(t for t in TARGETS if t.name == name)
    with contextlib.suppress(*target.allowed):
        target.decode(raw)
