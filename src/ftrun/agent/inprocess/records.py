"""What the wrapped ranks tell of their in-process restarts, turned into this node's events.

Each rank appends its records to `<job-dir>/inprocess/rank<N>.jsonl` (`ftrun.inprocess.events`).
It also tells the workers where to coordinate (`worker_env`). This service reads the records
while the workers run (every `POLL_S`, from where it stopped) and once
more when they stop or finish, and emits one `inprocess_recovered` event per restart iteration
of this node's ranks (the cause, the rank it came from, and the seconds from the fault to
every rank ready at the iteration's barrier) and an `inprocess_left` event per rank that left:
`ftrun report`, the metrics and the status page read them as any event.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ftrun.inprocess.events import SUBDIR
from ftrun.inprocess.iteration import Interruption, root_cause
from ftrun.inprocess.store import PREFIX_ENV, STORE_ENV
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService

POLL_S = 0.2


class InprocessRecords(NodeService):
    name = "inprocess-records"

    def __init__(
        self, job_dir: Path, emit: Callable[..., None], store_address: str | None, run_id: str
    ) -> None:
        self._folder, self._emit = job_dir / SUBDIR, emit
        self._store_address, self._run_id = store_address, run_id
        self._offsets: dict[Path, int] = {}
        self._seen: set[int] = set()  # this cycle's restart iterations already told
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def worker_env(self, rnd: Round) -> dict[str, str]:
        """Where wrapped ranks coordinate: the job's own c10d store (its real address: with
        --standalone the endpoint's port is 0), which outlives every worker (rank 0 can be lost
        and started again) and needs no port next to MASTER_PORT (NVRx's MASTER_PORT + 1 may be
        taken); the cycle's keys under their own prefix. Without one (etcd) the wrapper serves
        its own store, as under torchrun."""
        if self._store_address is None:
            return {}
        prefix = f"inprocess/{self._run_id}/{rnd.number}"
        return {STORE_ENV: self._store_address, PREFIX_ENV: prefix}

    def on_started(self, rnd: Round, pids: Iterable[int]) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="inprocess-records", daemon=True)
        self._thread.start()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self._halt()
        self.sweep()
        self._seen.clear()  # a new cycle numbers its iterations from 0 again

    def on_finished(self, rnd: Round) -> None:
        self.on_stopped(rnd, ())

    def close(self) -> None:
        self._halt()

    def sweep(self) -> None:
        """Read what the ranks wrote since the last sweep and emit its events."""
        with self._lock:
            for path in sorted(self._folder.glob("rank*.jsonl")):
                for record in self._new_records(path):
                    self._take(record)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.sweep()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
            self._thread = None

    def _new_records(self, path: Path) -> list[dict[str, object]]:
        start = self._offsets.get(path, 0)
        try:
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next read
        self._offsets[path] = start + len(complete)
        records = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a rank's file is the rank's: a bad line is skipped, not fatal
            if isinstance(record, dict):
                records.append(record)
        return records

    def _take(self, record: dict[str, object]) -> None:
        kind, iteration = record.get("event"), record.get("iteration")
        if not isinstance(iteration, int):
            return
        if kind == "inprocess_left":
            self._emit("inprocess_left", rank=record.get("rank"), iteration=iteration,
                       why=str(record.get("why", "")))  # fmt: skip
            return
        if kind != "inprocess_recovered":
            return
        if iteration in self._seen:  # another local rank's record of the same restart
            return
        causes = [Interruption.from_fields(c) for c in record.get("causes") or []
                  if isinstance(c, dict)]  # fmt: skip
        first = root_cause(causes) or Interruption(None, "?", "", 0.0)
        at = min((c.at for c in causes), default=0.0)
        ready = float(record.get("time", 0.0) or 0.0)
        self._seen.add(iteration)
        self._emit("inprocess_recovered", iteration=iteration, kind=first.kind,
                   from_rank=first.rank, why=first.why[:300],
                   seconds=round(max(0.0, ready - at), 4) if at else None)  # fmt: skip
