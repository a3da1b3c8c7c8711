"""The checkpoint keeper's exceptions: one hierarchy under `KeeperError`.

None of them stops training: the replicator logs them, the restore turns them into "restore
nothing" (-1), and a peer's bad request is refused with the message as its error reply.
"""

from __future__ import annotations

from ftrun.errors import FtrunError


class KeeperError(FtrunError):
    """Base of every checkpoint keeper error."""


class PartRejectedError(KeeperError, ValueError):
    """A peer's push or fetch names a part badly, is too big, or its bytes do not verify."""


class RestoreError(KeeperError):
    """The restore agreement could not finish (a message malformed, a wait timed out)."""
