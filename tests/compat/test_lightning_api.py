"""NVRx 0.7's Lightning callback arguments, written from its docs and signatures (no fit here:
tests/test_lightning.py runs real ones)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

lightning = pytest.importorskip("ftrun.lightning", reason="needs ftrun[lightning]")
FaultToleranceCallback = lightning.FaultToleranceCallback
SimulatedFaultParams = lightning.SimulatedFaultParams
LightningUsageError = lightning.LightningUsageError


def test_nvrx_positional_order_and_names() -> None:
    params = {"fault_type": "rank_killed", "base_delay": 5.0}
    cb = FaultToleranceCallback(True, False, params, "/tmp/exp", "my.logger")
    assert (cb.autoresume, cb.calculate_timeouts) == (True, False)
    assert cb.simulated_fault_params == SimulatedFaultParams("rank_killed", 5.0)
    assert str(cb.exp_dir) == "/tmp/exp" and cb.logger is logging.getLogger("my.logger")
    with pytest.raises(LightningUsageError):
        FaultToleranceCallback(simulated_fault_params={"fault_type": "meteor", "base_delay": 1})
    with pytest.raises(LightningUsageError):
        FaultToleranceCallback(simulated_fault_params={"base_delay": 1})


def test_the_random_rank_is_the_same_on_every_rank_and_only_it_fires() -> None:
    params = SimulatedFaultParams("rank_hung", base_delay=3600.0)
    fired = [params.start(rank, 8, seed="run:0") for rank in range(8)]
    assert sum(thread is not None for thread in fired) == 1


@pytest.mark.parametrize(("kind", "sig"), [("rank_killed", signal.SIGKILL),
                                           ("rank_hung", signal.SIGSTOP)])  # fmt: skip
def test_the_fault_fires_after_its_delay(kind: str, sig: signal.Signals) -> None:
    code = textwrap.dedent(f"""
        import time
        from ftrun.lightning import SimulatedFaultParams
        SimulatedFaultParams({kind!r}, 0.2, rank_to_fail=0).start(0, 1, "s")
        time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
    try:
        if sig == signal.SIGKILL:
            assert proc.wait(60) == -signal.SIGKILL  # the import alone takes seconds under load
        else:
            _, status = os.waitpid(proc.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
    finally:
        proc.kill()
        proc.wait(20)
