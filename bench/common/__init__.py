"""What the benches share (`from bench.common.<module> import ...`; a bench runs as
`python -m bench.<folder>.<script>` from the repository root).

- `jobs`: the launchers, one job of them (started, waited on, killed and checked gone), built on
  the tests' process harness;
- `harness`: that harness (tests/support.py, tests/launch.py, tests/etcd_cluster.py), the one
  place where bench/ reaches into tests/;
- `logs`: the workers' log lines (bench/workers/user_worker.py, ettr_worker.py);
- `report`: statistics, ratios, tables, the machine line, progress;
- `state`: the checkpoint benches' model + optimizer state, their scratch directories and disks;
- `timing`: the one timer (a phase, per call, the 99th percentile);
- `smoke`: what `--smoke` (every bench's seconds-long size, which `make test` runs) shares.

Here: the paths, and SIGTERM turned into an exit that runs the clean-up.
"""

from __future__ import annotations

import signal
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent
WORKERS = BENCH / "workers"
OUT = BENCH / "out"  # raw results (git-ignored)


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the clean-up


def exit_on_sigterm() -> None:
    """SIGTERM exits as Ctrl-C would, through every `finally` and `with` on the way out: the
    bench's jobs, directories and servers are cleaned up, not left running."""
    signal.signal(signal.SIGTERM, _terminate)
