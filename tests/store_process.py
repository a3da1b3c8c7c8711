"""`ftrun store --port PORT` as a test starts, kills and starts again (the store off the agents,
`--ft-store-reconnect-timeout`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from launch import free_port
from support import wait_for

RECONNECT_ARG = "--ft-store-reconnect-timeout=30"


class StoreProcess:
    """One `ftrun store` at a time on `port`; its output goes to `log` (appended)."""

    def __init__(self, log: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log = log
        self.starts = 0
        self.pids: list[int] = []
        self.proc = self._start()

    @property
    def launcher_args(self) -> tuple[str, ...]:
        """What puts a launcher's store here (after `start_job`'s flags: later flags win)."""
        return (f"--rdzv-endpoint=127.0.0.1:{self.port}", RECONNECT_ARG)

    def _start(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ftrun.tools.cli", "store", "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.pids.append(proc.pid)
        self.starts += 1
        wait_for(lambda: self._serving() >= self.starts, 30, "ftrun store to serve")
        return proc

    def _serving(self) -> int:
        return self.log.read_text(errors="replace").count("serving the rendezvous store")

    def restart(self) -> float:
        """SIGKILL it (its keys are lost) and start a new one on the same port; returns when
        the old one died (wall time, as the events' `ts`)."""
        self.proc.kill()
        self.proc.wait(10)
        killed_at = time.time()
        self.proc = self._start()
        return killed_at

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)
