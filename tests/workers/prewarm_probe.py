"""A worker that says how it was started: for the fork server's cycle tests. No torch.

Writes <ckpt-dir>/cycle<C>.json at once: its monotonic start, its thread count (OpenBLAS's pool
included, where numpy was imported before it ran) and the modules it found imported; then exits
1 in cycle 0 (a crash, so the job restarts) and 0 in later cycles.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

started = time.monotonic()
parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", type=Path, required=True)
parser.add_argument("--modules", default="numpy,slow_prewarm_module")
args = parser.parse_args()
if "numpy" in args.modules.split(","):
    import numpy  # noqa: F401 - a plain worker loads OpenBLAS here, a forked one had it already
cycle = int(os.environ["FTRUN_CYCLE"])
args.ckpt_dir.mkdir(parents=True, exist_ok=True)
record = {
    "started": started,
    "threads": len(os.listdir("/proc/self/task")),
    "imported": [m for m in args.modules.split(",") if m in sys.modules],
}
(args.ckpt_dir / f"cycle{cycle}.json").write_text(json.dumps(record))
sys.exit(1 if cycle == 0 else 0)
