"""Rank 0 fails once its peers are set up; the others ignore SIGTERM, as do their children.

Each non-zero rank starts a grandchild in its own process group and one that escapes with
setsid(); all three ignore SIGTERM. Every pid is appended to <dir>/pids.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--ckpt-dir") + 1])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    if rank == 0:
        deadline = time.monotonic() + 60
        while len(_pids(out)) < 3 * (int(os.environ["WORLD_SIZE"]) - 1):
            if time.monotonic() > deadline:
                sys.exit(2)
            time.sleep(0.01)
        sys.exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", IGNORE_TERM])
    escaped = subprocess.Popen([sys.executable, "-c", IGNORE_TERM], start_new_session=True)
    with (out / "pids").open("a") as f:
        f.write(f"{os.getpid()}\n{child.pid}\n{escaped.pid}\n")
    time.sleep(600)


def _pids(out: Path) -> list[int]:
    path = out / "pids"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


if __name__ == "__main__":
    main()
