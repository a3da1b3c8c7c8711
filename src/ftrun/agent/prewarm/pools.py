"""Native thread pools: limited while the fork server imports, given back in each worker.

OpenBLAS (numpy's, which `import torch` loads) starts its whole thread pool when the library
loads: 15 threads on a 16-core node with `OMP_NUM_THREADS` unset (torchrun sets it to 1 only
with several workers per node). A process with threads cannot fork safely, so the server
imports with OpenBLAS limited to one thread (`SERVER_ONLY_ENV`), and each forked child asks the
loaded library for the number of threads its own environment would have given it at load.

Other pools (OpenMP, MKL, torch's intra-op pool) start lazily, at the first parallel region, and
read the worker's environment then: nothing to give back. Standard library only: the server
imports this module before anything else.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

SERVER_ONLY_ENV: Mapping[str, str] = {"OPENBLAS_NUM_THREADS": "1"}
"""Set in the fork server's environment, never in a worker's."""

_OPENBLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
"""What OpenBLAS reads at load, first match wins (its `openblas_env.c`)."""
_SETTERS = (
    "openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",  # numpy >= 2 wheels: scipy-openblas, prefixed symbols
    "scipy_openblas_set_num_threads64_",
)


def openblas_threads(env: Mapping[str, str]) -> int:
    """The pool size OpenBLAS would pick at load with `env`: the first positive setting, else
    one thread per CPU this process may run on."""
    for name in _OPENBLAS_VARIABLES:
        head = env.get(name, "").split(",")[0].strip()
        if head.isdigit() and int(head) > 0:
            return int(head)
    return len(os.sched_getaffinity(0))


def restore_thread_pools(env: Mapping[str, str]) -> list[str]:
    """In a forked worker: resize every loaded OpenBLAS to what `env` asks; the libraries
    resized (none when the server's limit is already what the worker wants)."""
    wanted = openblas_threads(env)
    if wanted == openblas_threads(SERVER_ONLY_ENV):
        return []
    resized = []
    for path in _loaded_openblas():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        for symbol in _SETTERS:
            setter = getattr(lib, symbol, None)
            if setter is not None:
                setter.argtypes = [ctypes.c_int]
                setter.restype = None
                setter(wanted)
                resized.append(path)
                break
    return resized


def _loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries mapped into this process, in load order."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                path = fields[5].strip() if len(fields) == 6 else ""
                name = os.path.basename(path).lower()
                if "openblas" in name and ".so" in name and path not in found:
                    found.append(path)
    except OSError:
        return []
    return found
