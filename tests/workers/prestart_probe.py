"""A worker for the prestarted-worker cycle test (tests/test_prewarm_cycles.py). No torch.

Cycle 0: waits (30 s at most) until the fork server, its parent, holds another child (the
prestarted worker of the next cycle), writes <ckpt-dir>/cycle0.json with the time it crashes,
and exits 1. Later cycles write cycle<C>.json with their pid, process start time and cycle
variable, and exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", type=Path, required=True)
args = parser.parse_args()
cycle = int(os.environ["FTRUN_CYCLE"])
args.ckpt_dir.mkdir(parents=True, exist_ok=True)
me = psutil.Process()
record = {"pid": me.pid, "created": me.create_time(), "cycle_env": os.environ["FTRUN_CYCLE"]}
if cycle == 0:
    deadline = time.monotonic() + 30
    while not [c for c in me.parent().children() if c.pid != me.pid]:
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    record["crashed"] = time.time()
(args.ckpt_dir / f"cycle{cycle}.json").write_text(json.dumps(record))
sys.exit(1 if cycle == 0 else 0)
