"""What a forked worker keeps from the fork server's interpreter start, and must match.

A forked worker never starts an interpreter of its own: whatever Python and the native libraries
read at start-up (`IMPORT_TIME_PREFIXES`, `IMPORT_TIME_NAMES`) keeps the server's values, and so
does `sys.path[0]` while the prewarm modules import. So the server is started with the
`sys.path[0]` the workers will have (`path0`), and a worker whose start-up variables differ from
the server's is not forked (`start_env_mismatch`): the caller spawns it plainly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ftrun.agent.prewarm.target import PythonTarget

IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "GOTO_", "KMP_", "NUMEXPR_",
                        "VECLIB_", "LD_", "MALLOC_", "TORCHDYNAMO_", "TORCHINDUCTOR_",
                        "TORCH_COMPILE_")  # fmt: skip
IMPORT_TIME_NAMES = frozenset({"GLIBC_TUNABLES", "LANG", "LC_ALL", "LC_CTYPE", "TORCH_LOGS"})
"""Variables read when the interpreter or a native library starts: a forked worker keeps the
server's values, so a worker whose environment differs in one of them is not forked."""


def start_env_mismatch(server_env: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """The start-up variables (sorted) whose value in `env` is not the server's."""
    names = {
        k
        for k in {*env, *server_env}
        if k.startswith(IMPORT_TIME_PREFIXES) or k in IMPORT_TIME_NAMES
    }
    return sorted(k for k in names if env.get(k) != server_env.get(k))


def path0(target: PythonTarget) -> str:
    """`sys.path[0]` of `python -u [-m] target`, started in the current directory."""
    if target.module:
        return os.getcwd()
    path = os.path.abspath(target.target)
    return path if os.path.isdir(path) else os.path.dirname(os.path.realpath(path))
