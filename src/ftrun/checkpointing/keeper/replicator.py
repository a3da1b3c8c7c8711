"""The replicator: a background thread that copies this node's new parts off the training path.

Every `poll_s` it lists the session directories (names only; a header is read only for a part
it is about to send) for complete parts that this node's ranks wrote in the current round
(rank in this node's global ranks, the round's world size) and has not handled yet. For each
rank only the newest such part is handled; older ones it skips. Per the session's policy
(`POLICY_FILE`, written by the worker's manager) it then:

pushes the part with `sendfile` to the agents of the nodes hosting the other ranks of the
rank's clique (`push_targets`), one after the other, each push bounded by
`transfer_timeout(size)`; a failed push costs a WARNING line, the others go on. (The copy under
`root_local_ckpt_dir` is the worker's, within its save: `checkpointing.persist`.)

Then it moves the session's protection (`tier_files.PROTECTED_FILE`) to the newest iteration
of which this node holds every part it should (`holdings.held_ranks`: its ranks' and, with
replication, their cliques'), so that neither the workers' clean-up nor the replicas' drops
it before a newer one is whole here.

A session without a policy is looked at again next time; a malformed one is logged once and
its parts are not copied. Nothing here raises out of the thread: an error is logged (once
while it repeats) and the next poll tries again. `pause` (the agent is restoring) stops new
work; `resume(round)` takes every part present then as handled, so that only parts the new
round's workers write are copied.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ftrun.checkpointing.errors import CheckpointUsageError
from ftrun.checkpointing.keeper import holdings as plan
from ftrun.checkpointing.keeper.names import label
from ftrun.checkpointing.keeper.node_tier import NodeTier
from ftrun.checkpointing.keeper.settings import KeeperSettings
from ftrun.checkpointing.keeper.transfer import open_part, push_part
from ftrun.checkpointing.store import PartKey
from ftrun.checkpointing.tier_files import TierPolicy
from ftrun.peer import PeerClient, PeerError
from ftrun.rendezvous.ranks import Round

log = logging.getLogger("ftrun.agent")
Emit = Callable[..., None]


class Replicator:
    """See the module docstring. `start` once, `stop` once."""

    def __init__(
        self, tier: NodeTier, client: PeerClient, settings: KeeperSettings, emit: Emit
    ) -> None:
        self._tier = tier
        self._client = client
        self.polls = 0
        """Polls done so far (tests wait on it)."""
        self._settings = settings
        self._emit = emit
        self._lock = threading.Lock()
        self._ticking = threading.Lock()  # one pass at a time: the thread's, or a flush
        self._round: Round | None = None
        self._seen: set[tuple[str, PartKey]] = set()
        self._complaints: dict[str, str] = {}  # what was logged last, per topic: log once
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="ftrun-keeper-replicator", daemon=True
        )

    def start(self) -> Replicator:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop polling; wait (bounded) for a copy in progress. True if the thread ended."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("checkpoint keeper: the replicator still copies %gs after close", timeout)
        return not self._thread.is_alive()

    def pause(self) -> None:
        with self._lock:
            self._round = None

    def resume(self, rnd: Round) -> None:
        present = {(s, k) for s in self._tier.sessions() for k in self._tier.listed(s)}
        with self._lock:
            self._seen = present
            self._round = rnd

    def tick(self) -> None:
        """One poll: handle the parts this node's ranks wrote since the last one."""
        with self._ticking:
            self._tick()

    def _tick(self) -> None:
        with self._lock:
            rnd = self._round
        if rnd is None:
            return
        mine = range(rnd.first_global_rank, rnd.first_global_rank + rnd.me.local_world_size)
        present: set[tuple[str, PartKey]] = set()
        for session in self._tier.sessions():
            keys = self._tier.listed(session)
            present.update((session, k) for k in keys)
            with self._lock:
                new = [k for k in keys if (session, k) not in self._seen]
            new = [k for k in new if k.world_size == rnd.world_size and k.rank in mine]
            if new and not self._stop.is_set():
                self._handle_new(session, new, rnd)
            self._protect(session, keys, rnd)
        with self._lock:
            if self._round is rnd:
                self._seen &= present  # forget removed parts: a rewrite is new again

    def _run(self) -> None:
        while not self._stop.wait(self._settings.poll_s):
            try:
                self.tick()
            except Exception as exc:
                self._complain("tick", f"checkpoint keeper: replication failed: {exc!r}")
            self.polls += 1

    def _handle_new(self, session: str, new: list[PartKey], rnd: Round) -> None:
        try:
            policy = self._tier.read_policy(session)
            self._complaints.pop(session, None)
        except ValueError as exc:
            self._complain(session, f"checkpoint keeper: session {session}: {exc}; not copying")
            policy = TierPolicy()  # copy nothing, and do not look at these parts again
        if policy is None:
            return  # the manager has not written it yet: look again next time
        newest = {k.rank: k for k in sorted(new)}
        for key in new:
            if newest[key.rank] == key:
                self._handle(session, key, policy, rnd)
            with self._lock:
                self._seen.add((session, key))

    def _protect(self, session: str, keys: list[PartKey], rnd: Round) -> None:
        """Protect the newest iteration held whole here, if it is newer than the protected."""
        try:
            policy = self._tier.read_policy(session)
        except ValueError:
            return  # said once by `_handle_new`
        if policy is None:
            return
        sizes = [n.local_world_size for n in rnd.nodes]
        try:
            held = plan.held_ranks(rnd.world_size, policy.replication_jump,
                                   policy.replication_factor, plan.node_ranges(sizes),
                                   rnd.group_rank)  # fmt: skip
        except CheckpointUsageError:
            return  # said once by `_replicate`
        whole = plan.newest_held_whole(keys, held, rnd.world_size)
        protected = self._tier.read_protected(session)
        if whole >= 0 and (protected is None or protected[1] != rnd.world_size
                           or protected[0] < whole):  # fmt: skip
            self._tier.write_protected(session, whole, rnd.world_size)
            mine = range(rnd.first_global_rank, rnd.first_global_rank + rnd.me.local_world_size)
            stall = self._tier.read_stall(session, mine)
            self._emit("ckpt_held", session=session, iteration=whole, world_size=rnd.world_size,
                       stall=stall)  # fmt: skip

    def _handle(self, session: str, key: PartKey, policy: TierPolicy, rnd: Round) -> None:
        opened = open_part(self._tier.part_path(session, key))
        if opened is None:
            return
        fd, nbytes = opened
        try:
            if policy.replication_factor is not None and policy.replication_factor > 1:
                self._replicate(session, key, policy, rnd, fd, nbytes)
        finally:
            os.close(fd)

    def _replicate(
        self, session: str, key: PartKey, policy: TierPolicy, rnd: Round, fd: int, nbytes: int
    ) -> None:
        jump, factor = policy.replication_jump or 1, policy.replication_factor or 1
        sizes = [n.local_world_size for n in rnd.nodes]
        try:
            targets = plan.push_targets(
                key.rank, key.world_size, jump, factor, plan.node_ranges(sizes), rnd.group_rank
            )
        except CheckpointUsageError as exc:
            self._complain(f"{session}/clique", f"checkpoint keeper: not replicating: {exc}")
            return
        if not targets:
            self._complain(
                f"{session}/local/{key.rank}",
                f"checkpoint keeper: the clique of rank {key.rank} lies on this node "
                f"(replication_jump={jump}): no copy leaves it",
            )
            return
        started, sent = time.monotonic(), []
        timeout = self._settings.transfer_timeout(nbytes)
        for target in targets:
            node = rnd.nodes[target]
            address = (node.host, node.peer_port)
            try:
                push_part(self._client, address, session, key, rnd.number, fd, nbytes, timeout)
            except PeerError as exc:
                log.warning(
                    "checkpoint keeper: could not copy %s to %s: %s", label(key), node.node, exc
                )
                continue
            sent.append(node.node)
        if sent:
            self._emit("ckpt_replicated", session=session, iteration=key.iteration, rank=key.rank,
                       to=sent, bytes=nbytes, seconds=round(time.monotonic() - started, 6),
                       lag=round(max(time.time() - os.fstat(fd).st_mtime, 0.0), 6))  # fmt: skip

    def _complain(self, topic: str, message: str, *args: Any) -> None:
        """Log a problem once while it stays the same (a poll every 0.2 s must not flood)."""
        if self._complaints.get(topic) != message:
            self._complaints[topic] = message
            log.warning(message, *args)
