"""What a forked worker keeps from the fork server's interpreter start, and must match.

A forked worker never starts an interpreter of its own: whatever Python and the native libraries
read at start-up (`IMPORT_TIME_PREFIXES`, `IMPORT_TIME_NAMES`) keeps the server's values, and so
does `sys.path[0]` while the prewarm modules import. So the server is started with the
`sys.path[0]` the workers will have (`path0`), and a worker whose start-up variables differ from
the server's is not forked (`start_env_mismatch`): the caller spawns it plainly.

A server forked from the agent (`launch.fork_server`) had its interpreter started with the
agent's environment: only the variables read at import can be given the server's values (the
agent imports torch with them). So it is forked only where the agent's process started with the
server's values of the rest (`agent_start_mismatch`), and then serves exactly as if started
with `env`.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping

from ftrun.agent.prewarm.target import PythonTarget

IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "GOTO_", "KMP_", "NUMEXPR_",
                        "VECLIB_", "LD_", "MALLOC_", "TORCHDYNAMO_", "TORCHINDUCTOR_",
                        "TORCH_COMPILE_")  # fmt: skip
IMPORT_TIME_NAMES = frozenset({"GLIBC_TUNABLES", "LANG", "LC_ALL", "LC_CTYPE", "TORCH_LOGS"})
"""Variables read when the interpreter or a native library starts: a forked worker keeps the
server's values, so a worker whose environment differs in one of them is not forked."""


PROCESS_START_PREFIXES = ("PYTHON", "LD_", "MALLOC_")
PROCESS_START_NAMES = frozenset({"GLIBC_TUNABLES", "LANG", "LC_ALL", "LC_CTYPE"})
"""The start-up variables read when the process or its interpreter starts (the dynamic loader,
malloc, Python's own configuration and locale), before any module is imported."""
EMULATED = frozenset({"PYTHONFAULTHANDLER", "PYTHONUNBUFFERED"})
"""Read at interpreter start, but a forked server makes them true itself: it enables
faulthandler as `PYTHONFAULTHANDLER` says, and its stdio is always as `python -u` makes it."""


def start_env_mismatch(server_env: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """The start-up variables (sorted) whose value in `env` is not the server's."""
    return differing(server_env, env, IMPORT_TIME_PREFIXES, IMPORT_TIME_NAMES)


def differing(
    a: Mapping[str, str], b: Mapping[str, str], prefixes: tuple[str, ...],
    names: Collection[str] = (), skip: Collection[str] = (),
) -> list[str]:  # fmt: skip
    """The variables (sorted) that start with one of `prefixes` or are in `names`, not in
    `skip`, whose values in `a` and `b` differ (absent from one: they differ)."""
    return sorted(k for k in a.keys() | b.keys() if (k.startswith(prefixes) or k in names)
                  and k not in skip and a.get(k) != b.get(k))  # fmt: skip


def path0(target: PythonTarget) -> str:
    """`sys.path[0]` of `python -u [-m] target`, started in the current directory."""
    if target.module:
        return os.getcwd()
    path = os.path.abspath(target.target)
    return path if os.path.isdir(path) else os.path.dirname(os.path.realpath(path))


def agent_start_mismatch(agent_start: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """The variables read at process start (not `EMULATED`) whose value in `env`, a fork
    server's, is not the one this process started with (`agent_start`): a server forked from
    here would not be the one `env` starts."""
    return differing(agent_start, env, PROCESS_START_PREFIXES, PROCESS_START_NAMES, EMULATED)


def process_start_env() -> dict[str, str]:
    """The environment this process was started with (/proc/self/environ: later changes to
    os.environ do not show there), else os.environ."""
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    env = {}
    for entry in entries:
        name, sep, value = entry.partition(b"=")
        if sep and name:
            env[os.fsdecode(name)] = os.fsdecode(value)
    return env
