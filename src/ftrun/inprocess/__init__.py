"""In-process restart with NVRx 0.7's names: `import ftrun.inprocess as inprocess` in place of
`import nvidia_resiliency_ext.inprocess as inprocess`.

A fault in any rank restarts the wrapped function on every rank, inside the same processes.
Standalone (`torchrun`) the ranks coordinate through a store that rank 0 serves, as NVRx's do;
under `ft_launcher` through the agents' store, and the agents take part: a hang verdict or a
lost process interrupts the iteration too, and a rank whose process is gone is re-forked alone.
See docs/inprocess.md.
"""

from ftrun.inprocess import (
    abort,
    completion,
    exception,
    finalize,
    health_check,
    initialize,
    nested_restarter,
    rank_assignment,
    state,
    store,
    terminate,
)
from ftrun.inprocess.compose import Compose
from ftrun.inprocess.state import FrozenState, Mode, State
from ftrun.inprocess.wrap import CallWrapper, Wrapper

__all__ = [
    "CallWrapper",
    "Compose",
    "FrozenState",
    "Mode",
    "State",
    "Wrapper",
    "abort",
    "completion",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "nested_restarter",
    "rank_assignment",
    "state",
    "store",
    "terminate",
]
