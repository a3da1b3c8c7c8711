"""Where a forked worker's start-up time goes: moments written down as they happen.

In a forked worker, before its script runs, `install` arranges for three moments to be appended
to `<FTRUN_IPC_DIR>/startup-<pid>.marks` (one `NAME MONOTONIC` line each; the per-job 0700
directory, CLOCK_MONOTONIC being the same for every process of the host):

- `script`: the script starts (the fork and the worker's set-up are done);
- `cuda`: torch finished initialising CUDA in this process (torch's own lazy-init queue, which
  runs once the context exists; at `script` for a prestarted worker, which made it earlier);
- `pg`: `torch.distributed.init_process_group` returned (the store rendezvous; NCCL creates
  its communicators later, at the first collective).

The agent reads them (`read_marks`) when the rank first shows progress and writes a
`rank_startup` event. Beside them, the first call of `torch.compile` in any worker of the job
creates `<FTRUN_IPC_DIR>/compiles` (`compiles_seen`): the node's prestarted workers then import
inductor's compiler before their go (`prestart.PRELOAD_ON_COMPILE`). A plainly spawned worker
runs no code of ours before its script, so it has no marks: its split is only spawn -> first
step. Standard library only (the fork server imports this module); nothing here may raise into
the worker's script.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ftrun.environment import Env

MARK_NAMES = ("script", "cuda", "pg")
COMPILES_FLAG = "compiles"


def marks_path(job_dir: str | Path, pid: int) -> Path:
    return Path(job_dir) / f"startup-{pid}.marks"


def install(env: Mapping[str, str]) -> None:
    """In a forked worker about to run its script: mark `script` now, `cuda` and `pg` later."""
    job_dir = env.get(Env.JOB_DIR)
    if not job_dir:
        return
    mark = functools.partial(_mark, marks_path(job_dir, os.getpid()))
    mark("script")
    cuda = sys.modules.get("torch.cuda")
    lazy_call = getattr(cuda, "_lazy_call", None)
    if lazy_call is not None and not cuda.is_initialized():  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            lazy_call(functools.partial(mark, "cuda"))
    elif lazy_call is not None:  # prestarted: the context was made before the script
        mark("cuda")
    _wrap_init_process_group(functools.partial(mark, "pg"))
    _wrap_torch_compile(Path(job_dir) / COMPILES_FLAG)


def compiles_seen(env: Mapping[str, str]) -> bool:
    """Whether a worker of this job (`env`'s) called `torch.compile`."""
    job_dir = env.get(Env.JOB_DIR)
    return bool(job_dir) and (Path(job_dir) / COMPILES_FLAG).exists()


def _wrap_init_process_group(mark: Callable[[], None]) -> None:
    """Note when `init_process_group` returns, under both names a script may call it by."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    dist = sys.modules.get("torch.distributed")
    original = getattr(c10d, "init_process_group", None)
    if original is None or dist is None:
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        mark()
        return result

    for module in (c10d, dist):
        if getattr(module, "init_process_group", None) is original:
            module.init_process_group = init_process_group  # type: ignore[attr-defined]


def _wrap_torch_compile(flag: Path) -> None:
    """Create `flag` at the first call of `torch.compile` (as a call or a decorator)."""
    torch = sys.modules.get("torch")
    original = getattr(torch, "compile", None)
    if original is None:
        return

    @functools.wraps(original)
    def compile_marked(*args: Any, **kwargs: Any) -> Any:
        if torch.compile is compile_marked:  # type: ignore[union-attr]
            torch.compile = original  # type: ignore[union-attr]
            with contextlib.suppress(OSError):
                flag.touch(mode=0o600)
        return original(*args, **kwargs)

    torch.compile = compile_marked  # type: ignore[union-attr]


def _mark(path: Path, name: str) -> None:
    with contextlib.suppress(OSError):
        append(path, f"{name} {time.monotonic():.6f}\n".encode())


def append(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Append `data` to `path` (created with `mode`) in one O_APPEND write: the lines of
    several writers never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_marks(job_dir: str | Path, pid: int) -> dict[str, float]:
    """A worker's marks (name -> monotonic time; the first of each name); {} for none. The file
    is the worker's to write: malformed lines are skipped, never trusted beyond a float."""
    marks: dict[str, float] = {}
    try:
        text = marks_path(job_dir, pid).read_text(errors="replace")[:4096]
    except OSError:
        return marks
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in MARK_NAMES and name not in marks:
            with contextlib.suppress(ValueError):
                at = float(value)
                if math.isfinite(at):
                    marks[name] = at
    return marks


def forget_marks(job_dir: str | Path, pid: int) -> None:
    with contextlib.suppress(OSError):
        marks_path(job_dir, pid).unlink()
