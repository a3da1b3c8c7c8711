"""The node agent's checkpoint keeper (issue 15, items 3 and 4): holds the workers' parts in node
memory, copies them to peers and to disk off the training path, and before each round's workers
start agrees with the other nodes on the iteration to restore and fetches what this node lacks.
`service` is the entry point; `holdings` holds every decision as a pure function.
"""

from ftrun.agent.keeper.service import KeeperService
from ftrun.agent.keeper.settings import KeeperSettings

__all__ = ["KeeperService", "KeeperSettings"]
