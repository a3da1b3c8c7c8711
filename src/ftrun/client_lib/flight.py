"""The worker's side of collective-level hang attribution: dump PyTorch's flight recorder when
the node's agent asks.

A rank hung in a collective is blocked in C++ with the GIL released, so a Python signal
handler would never run (the main thread never returns to the interpreter). Instead, a daemon
thread blocks reading a FIFO in the job's 0700 directory (`fr/rank<R>-pid<P>.fifo`), so it
costs nothing until the agent writes a request (one line per request).
The agent writes where the dump goes; the thread calls torch's JSON dump (NCCL's
`_dump_nccl_trace_json`, or the general `_dump_fr_trace_json` for gloo: no pickle) and renames
the file into place.

Started by `RankMonitorClient.init_workload_monitoring()` when the flight recorder is on
(`TORCH_FR_BUFFER_SIZE`, or its NCCL-era name, above 0); importing this module never imports
torch, and a dump is only attempted once the training script has imported it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from pathlib import Path

from ftrun.owned_dir import replace_file

FR_DIR = "fr"
"""Under the job's IPC directory: the FIFOs and the dumps."""
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch 2.13 reads the first, falling back to the second (distributed_c10d.py)."""
_MAX_REQUEST = 4096
_listener: threading.Thread | None = None
"""This process's listener: one, however many clients it makes (a fork gets its own)."""


def fifo_path(job_dir: Path, rank: int, pid: int) -> Path:
    return job_dir / FR_DIR / f"rank{rank}-pid{pid}.fifo"


def recorder_on(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether torch records collectives in this process (a buffer size above 0)."""
    for name in BUFFER_VARS:
        if name in environ:
            try:
                return int(environ[name]) > 0
            except ValueError:
                return False
    return False


def start_listener(job_dir: Path, rank: int) -> threading.Thread | None:
    """Create this rank's FIFO and the thread that answers dump requests, once per process;
    None if the recorder is off."""
    global _listener
    fifo = fifo_path(job_dir, rank, os.getpid())
    if _listener is not None and _listener.is_alive() and fifo.exists():
        return _listener
    if not recorder_on():
        return None
    try:
        fifo.parent.mkdir(mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            fifo.unlink()
        os.mkfifo(fifo, 0o600)
        # Both ends open here, before the thread starts: the agent can write as soon as the
        # FIFO exists, and our own writer keeps reads blocking (never an end-of-file).
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        os.open(fifo, os.O_WRONLY | os.O_CLOEXEC)  # held for the life of the process
        os.set_blocking(reader, True)
    except OSError:
        return None  # no attribution for this rank; training goes on
    thread = threading.Thread(
        target=_serve, args=(reader, job_dir / FR_DIR), name="ftrun-flight-recorder", daemon=True
    )
    thread.start()
    _listener = thread
    return thread


def _serve(reader: int, out_dir: Path) -> None:
    pending = b""
    while True:
        try:
            chunk = os.read(reader, _MAX_REQUEST)  # blocks until the agent writes a request
        except OSError:
            return
        pending += chunk
        *requests, pending = pending.split(b"\n")
        for request in requests:
            target = Path(request.decode("utf-8", "replace").strip())
            # Only a plain file name in our own directory: the FIFO is the agent's, be strict.
            if target.parent == out_dir and target.name.endswith(".json"):
                _dump(target)


def _recorded(c10d: object) -> bytes:
    """torch's JSON dump of the recorder that saw this rank's collectives: NCCL's own
    (`_dump_nccl_trace_json`, torch 2.11 on the device) when it recorded any, else the general
    one (gloo and the other backends)."""
    if (nccl := getattr(c10d, "_dump_nccl_trace_json", None)) is not None:
        data = nccl(True, False)
        if json.loads(data).get("entries"):
            return data
    return c10d._dump_fr_trace_json(True, False)  # type: ignore[attr-defined]


def _dump(target: Path) -> None:
    """Write the dump, or why there is none: the agent waits for the file either way."""
    torch = sys.modules.get("torch")
    if torch is None:  # the script never imported torch: nothing was recorded
        data: bytes = b'{"unavailable": "torch is not imported"}'
    else:
        try:
            data = _recorded(torch._C._distributed_c10d)
        except Exception as exc:
            data = json.dumps({"unavailable": f"{type(exc).__name__}: {exc}"}).encode()
    with contextlib.suppress(OSError):
        replace_file(target, data if isinstance(data, bytes) else str(data))
