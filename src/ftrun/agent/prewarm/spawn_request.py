"""One spawn in flight between the agent's `ForkServer` and its fork server.

The agent sends the server the write ends of a worker's stdout and stderr pipes (and, with a
start gate, the gate's read end) and keeps the other ends here until the server's reply: a
"spawned" note turns them into the `ForkedWorker`, an "error" note into the refusal's text.
"""

from __future__ import annotations

import dataclasses
import threading

from ftrun.agent.prewarm.forked import ForkedWorker
from ftrun.agent.prewarm.wire import close_fds


@dataclasses.dataclass(eq=False)
class SpawnRequest:
    """One spawn in flight: the pipes' read ends until the reply turns them into a worker."""

    stdout_fd: int
    stderr_fd: int
    gate_fd: int | None
    """The start gate's write end (with `announce`): one byte lets the child run."""
    args: list[str]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    worker: ForkedWorker | None = None
    error: str | None = None

    def discard(self) -> None:
        if self.worker is not None:
            self.worker.stdout.close()
            self.worker.stderr.close()
        else:
            close_fds(self.stdout_fd, self.stderr_fd)
