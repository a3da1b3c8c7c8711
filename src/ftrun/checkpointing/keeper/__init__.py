"""The checkpoint keeper, a node service the builder hands the agent (`keeper_service`): holds
the workers' parts in node memory, copies them to peers off the training path, and before each
round's workers start agrees with the other nodes on the iteration to restore and fetches what
this node lacks. `service` is the entry point; `holdings` holds every decision as a pure
function.
"""

from ftrun.checkpointing.keeper.service import KeeperService, keeper_service
from ftrun.checkpointing.keeper.settings import KeeperSettings

__all__ = ["KeeperService", "KeeperSettings", "keeper_service"]
