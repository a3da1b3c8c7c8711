"""Applying a worker's `--numa-binding` inside the worker: its CPUs, then its memory nodes.

The agent decides each local rank's binding once per launch (`placement.numa`) and hands it over
in two variables of the worker's environment, in Linux's cpulist syntax ("0-7,16-23"):
`FTRUN_CPU_BIND` (logical CPUs) and `FTRUN_MEM_BIND` (NUMA memory nodes). Either may be absent.

- A plain-spawned worker: `prepare_binding` runs in the agent (parsing, the libc lookup, the
  node mask) and the closure it returns runs in the child between fork and exec, where only
  system calls are safe: another agent thread may hold the import lock, a logging lock or the
  dynamic loader's lock at the fork.
- A worker forked by the fork server: `apply_binding(os.environ)` once the worker's environment
  is in place (`prewarm.child.become_worker`; that process is single-threaded).

Memory: MPOL_BIND over the nodes (what `numactl --membind` does), for every mode: allocations
come from those nodes only, never spill to a remote node. A worker that outgrows its node's memory
fails there instead of running slowly on remote memory. MPOL_PREFERRED would take one node only
(socket mode names several). Both settings are inherited by the threads and processes the worker
starts later, so they are made before its program runs. If `set_mempolicy` is refused (a
container's seccomp profile: EPERM; a node outside the cgroup's cpuset: EINVAL; ENOSYS), one line
goes to stderr and the CPU binding stays; likewise if the CPUs cannot be set.

Standard library only and nothing done at import: the fork server imports this module, and what
it imports ends up in every worker.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Mapping

from ftrun.environment import Env

MPOL_BIND = 2
"""linux/mempolicy.h: allocate only from the given nodes."""
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
"""set_mempolicy(2)'s number: arch/x86/entry/syscalls/syscall_64.tbl; the generic table
(include/uapi/asm-generic/unistd.h) that arm64 uses. Python's os module has no call for it."""
_WORD_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


def parse_cpulist(text: str) -> frozenset[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}; `ValueError` for anything else."""
    items: set[int] = set()
    for part in text.strip().split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a cpulist: {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"not a cpulist: {text!r} (range {part.strip()} runs backwards)")
        items.update(range(low, high + 1))
    return frozenset(items)


def format_cpulist(items: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8, 10, 11} -> '0-3,8,10-11' (the form sysfs and `taskset -c` use)."""
    parts: list[str] = []
    ordered = sorted(set(items))
    start = 0
    for i, item in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != item + 1:
            low = ordered[start]
            parts.append(str(low) if low == item else f"{low}-{item}")
            start = i + 1
    return ",".join(parts)


def apply_binding(env: Mapping[str, str]) -> None:
    """Bind this process as `env`'s FTRUN_CPU_BIND/FTRUN_MEM_BIND say (absent: nothing)."""
    apply = prepare_binding(env)
    if apply is not None:
        apply()


def prepare_binding(env: Mapping[str, str]) -> Callable[[], None] | None:
    """Everything but the system calls, done now; the returned call makes them (None: no
    binding). `ValueError` for a malformed variable (the agent writes them: a bug)."""
    cpus_text, mems_text = env.get(Env.CPU_BIND, ""), env.get(Env.MEM_BIND, "")
    if not cpus_text and not mems_text:
        return None
    cpus = parse_cpulist(cpus_text) if cpus_text else None
    bind_memory = _memory_binder(mems_text) if mems_text else None

    def apply() -> None:
        if cpus is not None:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError as exc:
                _say(f"CPU binding to {cpus_text} not applied: {exc.strerror or exc}")
        if bind_memory is not None:
            bind_memory()

    return apply


def _memory_binder(mems_text: str) -> Callable[[], None]:
    """set_mempolicy(MPOL_BIND, mask, maxnode) for those nodes, ready to call."""
    nodes = parse_cpulist(mems_text)
    machine = os.uname().machine
    number = _SYS_SET_MEMPOLICY.get(machine)
    if number is None:
        why = f"memory binding to node(s) {mems_text} skipped: set_mempolicy unknown on {machine}"
        return lambda: _say(why)
    words = max(nodes) // _WORD_BITS + 1
    mask = (ctypes.c_ulong * words)()
    for node in nodes:
        mask[node // _WORD_BITS] |= 1 << (node % _WORD_BITS)
    # The kernel reads maxnode - 1 bits (an old off-by-one that libnuma also pays): one more.
    maxnode = ctypes.c_ulong(words * _WORD_BITS + 1)
    syscall = ctypes.CDLL(None, use_errno=True).syscall  # looked up here, not after a fork
    syscall.restype = ctypes.c_long
    args = (ctypes.c_long(number), ctypes.c_long(MPOL_BIND), mask, maxnode)

    def bind() -> None:
        if syscall(*args) != 0:
            reason = os.strerror(ctypes.get_errno())
            _say(f"memory binding to node(s) {mems_text} not applied ({reason}); CPU binding kept")

    return bind


def _say(message: str) -> None:
    """One line to fd 2: sys.stderr's lock may be held by a thread that the fork left behind."""
    os.write(2, f"ftrun: {message}\n".encode())
