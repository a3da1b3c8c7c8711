"""The process groups of the wrapped function between restart iterations: what a stopped
iteration's groups hold is let go (`release`), and the next iteration's groups get names of
their own (`fresh_group_names`)."""

from __future__ import annotations

import faulthandler
import gc
import time
import traceback

_NAMES_PER_ITERATION = 100_000


def fresh_group_names(iteration: int) -> None:
    """Process groups made in iteration N get names no other iteration uses. torch restarts
    its group names at "0" once the groups are destroyed, so a plain `init_process_group()`
    (env://, the launcher's store) would read the keys an earlier iteration's group left there:
    a peer's old address (gloo: connection refused), an old NCCL id, a store barrier already
    counted. NVRx's examples avoid it with a store prefix per iteration; a plain script should
    not need one."""
    import torch.distributed as dist

    world = dist.distributed_c10d._world  # torch has no public way to name the default group
    if iteration > 0 and not dist.is_initialized():
        world.group_count = max(world.group_count, iteration * _NAMES_PER_ITERATION)


def release(stopped: BaseException | None, bound_s: float) -> None:
    """Free what the stopped function held, its process groups first: a gloo peer blocked in a
    collective with this rank returns only once this rank's sockets close (an abort does not
    close them), which is when the last reference to the group goes. The function's frames are
    over but still held by the exception's traceback: their locals are cleared, and the
    collection that follows (cheap: `wrap.CallWrapper` freezes what existed before the first
    call) frees the cycles (DDP's reducer).

    A gloo group's destructor joins its worker threads while this thread holds the GIL, and a
    worker that just failed a collective needs the GIL for a moment to free it: the GIL is let
    go first (a few milliseconds drain them), and faulthandler's watchdog, a C thread that needs
    no GIL, ends the process if the release still deadlocks (the launcher then restarts it)."""
    time.sleep(_DRAIN_S)
    faulthandler.dump_traceback_later(bound_s, exit=True)
    try:
        seen: set[int] = set()
        while stopped is not None and id(stopped) not in seen:
            seen.add(id(stopped))
            traceback.clear_frames(stopped.__traceback__)
            stopped = stopped.__cause__ or stopped.__context__
        gc.collect()
    finally:
        faulthandler.cancel_dump_traceback_later()


_DRAIN_S = 0.01
