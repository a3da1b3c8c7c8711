"""Parts over the peer channel: the two request kinds the keeper serves, and its calls to them.

`ckpt-push` (a peer sends a new part of one of its ranks): refused unless the keeper is
accepting (not closing, not restoring) and the push comes from the same round; the fields
(`messages.parse_part_request`), the size (at least `MIN_PART_BYTES`, at most the settings'
maximum and what the filesystem has free) and, once received, the bytes themselves
(`NodeTier.install`) must all check out, else nothing is kept and the sender gets the reason
as its error (the peer server logs it). At most one receive per (session, rank, world size)
at a time; after one, that rank keeps its newest `keep_complete` parts and its part of the
protected iteration (`tier_files.PROTECTED_FILE`).

`ckpt-fetch` (a peer restoring its ranks asks for a part): the reply's bulk bytes are the file,
sent with `sendfile` from an open descriptor (the file may be removed meanwhile; the bytes stay
readable until the send ends).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

from ftrun.checkpointing.errors import CheckpointError
from ftrun.checkpointing.format import PartInfo, read_info
from ftrun.checkpointing.keeper import holdings as plan
from ftrun.checkpointing.keeper.errors import PartRejectedError
from ftrun.checkpointing.keeper.messages import parse_part_request, part_request
from ftrun.checkpointing.keeper.names import MIN_PART_BYTES, label
from ftrun.checkpointing.keeper.node_tier import NodeTier
from ftrun.checkpointing.keeper.settings import KeeperSettings
from ftrun.checkpointing.store import PartKey
from ftrun.peer import FileRegion, PeerClient, Reply, Request

log = logging.getLogger("ftrun.agent")

PUSH = "ckpt-push"
FETCH = "ckpt-fetch"


class PartServer:
    """The keeper's handlers; `cycle` is the round whose pushes it accepts (None: none)."""

    def __init__(self, tier: NodeTier, settings: KeeperSettings) -> None:
        self._tier = tier
        self._settings = settings
        self._lock = threading.Lock()
        self._receiving: set[tuple[str, int, int]] = set()
        self.cycle: int | None = None

    def handle_push(self, request: Request) -> dict[str, object]:
        session, key, cycle = parse_part_request(request.header, "cycle")
        if self.cycle is None or cycle != self.cycle:
            raise PartRejectedError(f"a push of round {cycle}; this node is in {self.cycle}")
        self._check_size(request.nbytes)
        # A part already here is replaced all the same: one of the same name from a timeline
        # the job left must not stay in place of the new one.
        slot = (session, key.rank, key.world_size)
        with self._lock:
            if slot in self._receiving:
                raise PartRejectedError(f"already receiving a part of rank {key.rank}")
            self._receiving.add(slot)
        try:
            self._tier.install(session, key, request.nbytes, request.read_into)
            same = [k for k in self._tier.listed(session) if k.rank == key.rank]
            protected = self._tier.read_protected(session)
            doomed = plan.retention(same, self._settings.keep_complete, protected)
            self._tier.remove(session, doomed)
        finally:
            with self._lock:
                self._receiving.discard(slot)
        log.debug("checkpoint keeper: got %s of session %s from %s (%d bytes)", label(key), session,
                  request.peer, request.nbytes)  # fmt: skip
        return {"stored": True}

    def handle_fetch(self, request: Request) -> Reply:
        session, key, nbytes = parse_part_request(request.header, "nbytes")
        if request.nbytes:
            raise PartRejectedError("a fetch carries no bulk bytes")
        path = self._tier.part_path(session, key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PartRejectedError(f"no {label(key)} of session {session} here") from None
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise PartRejectedError(f"{label(key)} has {size} bytes here, not {nbytes}")
            read_info(f"/proc/self/fd/{fd}")  # the header of the very file we send
        except BaseException:
            os.close(fd)
            raise
        return Reply({"nbytes": size}, FileRegion(fd, 0, size), lambda: os.close(fd))

    def _check_size(self, nbytes: int) -> None:
        most = self._settings.max_part_bytes
        if not MIN_PART_BYTES <= nbytes <= most:
            raise PartRejectedError(f"{nbytes} bytes: a part has {MIN_PART_BYTES} to {most}")
        free = self._tier.free_bytes() - self._settings.free_reserve_bytes
        if nbytes > free:
            raise PartRejectedError(f"{nbytes} bytes do not fit ({max(free, 0)} free)")


def push_part(
    client: PeerClient,
    address: tuple[str, int],
    session: str,
    key: PartKey,
    cycle: int,
    fd: int,
    nbytes: int,
    timeout: float,
) -> bool:
    """Send the part open as `fd` with `sendfile`; True once the peer stored it. Raises
    `PeerError` (`PeerRemoteError` carries the peer's refusal)."""
    reply = client.push(*address, PUSH, part_request(session, key, cycle=cycle),
                        FileRegion(fd, 0, nbytes), timeout=timeout)  # fmt: skip
    return bool(reply.get("stored"))


def fetch_part(
    client: PeerClient,
    tier: NodeTier,
    address: tuple[str, int],
    session: str,
    key: PartKey,
    nbytes: int,
    timeout: float,
) -> PartInfo:
    """Bring one part from a peer straight into a new file of this node, verified."""
    header = part_request(session, key, nbytes=nbytes)

    def fill(mapping: object) -> None:
        client.fetch_into(*address, FETCH, header, mapping, timeout=timeout)

    return tier.install(session, key, nbytes, fill)


def open_part(path: Path) -> tuple[int, int] | None:
    """(descriptor, size) of a complete part whose header reads valid; None if it is gone or
    bad (logged). The caller closes the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        read_info(f"/proc/self/fd/{fd}")
        return fd, os.fstat(fd).st_size
    except (CheckpointError, OSError) as exc:
        log.warning("checkpoint keeper: not sending %s: %s", path, exc)
        with contextlib.suppress(OSError):
            os.close(fd)
        return None
