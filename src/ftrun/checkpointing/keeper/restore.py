"""The restore agreement of one round, run by every node's keeper before its workers start.

Store keys, all under `ftrun/<run_id>/c<cycle>/ckpt/` (per cycle: a new round starts afresh):

    <group rank>           each node's holdings (complete parts, header-checked, with sizes)
    a<k>                   the decision of attempt k, written by the decider (group rank 0)
    a<k>/<group rank>      each node's outcome of attempt k's fetches
    final                  the final decision, set once with compare-and-set

1. Every node publishes its holdings. The decider waits (at most `gather_s`) for those of the
   round's nodes, decides (`holdings.first_decision`) and publishes attempt 0.
2. A node waits for attempt k's decision (bounded). If it is final, done. Else it fetches its
   ranks' missing parts of each session's chosen iteration from nodes that hold them (each
   holder in turn; every fetch bounded; all of them together within `fetch_s`), publishes its
   outcome, and the decider, once every outcome is in (bounded), publishes attempt k+1
   (`holdings.next_decision`): final if every node got its parts, else a fallback.
3. Only `final` decides what the workers load, and it is set once: the decider sets it with
   compare-and-set, and so does a node that gives up waiting, with "restore nothing" (abort).
   Whoever is first wins and every node reads the same value, so a late decider and an
   impatient node can never make the job's ranks load different iterations.

A holder that dies mid-transfer costs its fetcher a timeout (never a hang) and a fallback. If
the decider dies, the others give up at their deadline and restore nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict

from torch.distributed import Store

from ftrun.checkpointing.errors import CheckpointError
from ftrun.checkpointing.keeper import holdings as plan
from ftrun.checkpointing.keeper.errors import PartRejectedError, RestoreError
from ftrun.checkpointing.keeper.holdings import Decision, Holdings, Outcome
from ftrun.checkpointing.keeper.messages import (
    decode_decision,
    decode_holdings,
    decode_outcome,
    encode_decision,
    encode_holdings,
    encode_outcome,
)
from ftrun.checkpointing.keeper.names import label
from ftrun.checkpointing.keeper.node_tier import NodeTier
from ftrun.checkpointing.keeper.settings import KeeperSettings
from ftrun.checkpointing.keeper.transfer import fetch_part
from ftrun.checkpointing.store import PartKey
from ftrun.peer import PeerClient, PeerError
from ftrun.rendezvous.ranks import Round
from ftrun.store.ops import existing_keys, wait_for_keys

log = logging.getLogger("ftrun.agent")

_WAIT_SLICE_S = 1.0


@dataclasses.dataclass
class Fetched:
    """What one node fetched for one session."""

    parts: int = 0
    bytes: int = 0
    sources: list[str] = dataclasses.field(default_factory=list)

    def add(self, node: str, nbytes: int) -> None:
        self.parts += 1
        self.bytes += nbytes
        if node not in self.sources:
            self.sources.append(node)


class RestoreRun:
    """One node's part in one round's agreement; `run` once (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        rnd: Round,
        tier: NodeTier,
        client: PeerClient,
        settings: KeeperSettings,
    ) -> None:
        self._store = store
        self._rnd = rnd
        self._tier = tier
        self._client = client
        self._settings = settings
        self._prefix = f"ftrun/{run_id}/c{rnd.number}/ckpt"
        self._ranges = plan.node_ranges([n.local_world_size for n in rnd.nodes])
        self._holdings: dict[int, Holdings] | None = None
        self.fetched: dict[str, Fetched] = defaultdict(Fetched)
        self.attempts = 0

    def run(self) -> Decision:
        """The final decision. Raises on a store error (the caller restores nothing)."""
        me = self._rnd.group_rank
        holdings = encode_holdings(self._rnd.me.node, self._tier.holdings())
        self._store.set(f"{self._prefix}/{me}", holdings)
        if me == 0:
            self._holdings = self._gather_holdings()
            self._publish(plan.first_decision(self._holdings, self._ranges))
        attempt = 0
        while True:
            decision = self._await(attempt)
            if decision.final:
                return decision
            self.attempts = attempt + 1
            outcome = self._fetch(decision)
            self._store.set(f"{self._prefix}/a{attempt}/{me}", encode_outcome(outcome))
            if me == 0:
                assert self._holdings is not None
                outcomes = self._gather_outcomes(attempt)
                settled = plan.next_decision(
                    decision, self._holdings, outcomes, self._ranges, self._settings.attempts
                )
                _log_fallbacks(decision, settled)
                self._publish(settled)
            attempt += 1

    def abort(self, why: str) -> Decision:
        """Make the job restore nothing, unless a final decision exists: the one in force."""
        aborted = Decision(0, True, {}, aborted=f"{self._rnd.me.node}: {why}")
        raw = self._store.compare_set(f"{self._prefix}/final", "", encode_decision(aborted))
        return decode_decision(raw)

    # ---- the decider -----------------------------------------------------------------------

    def _gather_holdings(self) -> dict[int, Holdings]:
        keys = [f"{self._prefix}/{g}" for g in range(len(self._ranges))]
        if not self._wait_all(keys, self._settings.gather_s):
            missing = sorted(set(keys) - set(existing_keys(self._store, keys)))
            log.warning(
                "checkpoint keeper: no holdings from %s within %gs: deciding without",
                [k.rsplit("/", 1)[1] for k in missing],
                self._settings.gather_s,
            )
        found: dict[int, Holdings] = {}
        for key in existing_keys(self._store, keys):
            try:
                found[int(key.rsplit("/", 1)[1])] = decode_holdings(self._store.get(key))
            except RestoreError as exc:
                log.warning("checkpoint keeper: ignoring %s: %s", key, exc)
        return found

    def _gather_outcomes(self, attempt: int) -> dict[int, Outcome | None]:
        keys = [f"{self._prefix}/a{attempt}/{g}" for g in range(len(self._ranges))]
        self._wait_all(keys, self._settings.fetch_s + self._settings.gather_s)
        outcomes: dict[int, Outcome | None] = dict.fromkeys(range(len(keys)))
        for key in existing_keys(self._store, keys):
            node = int(key.rsplit("/", 1)[1])
            try:
                outcomes[node] = decode_outcome(self._store.get(key))
            except RestoreError as exc:
                outcomes[node] = Outcome(aborted=f"malformed outcome: {exc}")
        return outcomes

    def _wait_all(self, keys: list[str], timeout: float) -> bool:
        """Wait (bounded) for every key; stop early once a final decision exists (a node gave
        up: nothing more is coming). True if they all exist."""
        deadline, final = time.monotonic() + timeout, [f"{self._prefix}/final"]
        while True:
            left = deadline - time.monotonic()
            if wait_for_keys(self._store, keys, min(_WAIT_SLICE_S, max(left, 0.0))):
                return True
            if left <= 0 or self._store.check(final):
                return False

    def _publish(self, decision: Decision) -> None:
        raw = encode_decision(decision)
        if decision.final:
            raw = self._store.compare_set(f"{self._prefix}/final", "", raw).decode()
        self._store.set(f"{self._prefix}/a{decision.attempt}", raw)  # wakes the waiting nodes

    # ---- every node ------------------------------------------------------------------------

    def _await(self, attempt: int) -> Decision:
        """Attempt `attempt`'s decision, or the final one; gives up (abort) at the deadline."""
        gather, final = self._settings.gather_s, f"{self._prefix}/final"
        patience = 2 * gather + (self._settings.fetch_s if attempt else 0.0)
        deadline = time.monotonic() + patience
        key = f"{self._prefix}/a{attempt}"
        while True:
            if self._store.check([final]):
                return decode_decision(self._store.get(final))
            if self._store.check([key]):
                decision = decode_decision(self._store.get(key))
                if not decision.final:
                    return decision
                continue  # the final key is set before its wake-up copy: read it
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("checkpoint keeper: no restore decision within %gs", patience)
                return self.abort(f"no decision for attempt {attempt} within {patience:g}s")
            wait_for_keys(self._store, [key], min(_WAIT_SLICE_S, left))

    def _fetch(self, decision: Decision) -> Outcome:
        """Fetch this node's missing parts of every session's choice; report what failed."""
        if self._holdings is None:
            self._holdings = {
                node: decode_holdings(self._store.get(f"{self._prefix}/{node}"))
                for node in decision.sources
            }
        me, deadline = self._rnd.group_rank, time.monotonic() + self._settings.fetch_s
        failed: dict[str, frozenset[int]] = {}
        for session, choice in sorted(decision.choices.items()):
            parts = plan.parts_by_node(self._holdings, session, decision.excluded)
            todo = plan.fetch_plan(choice, parts, me, self._ranges[me], self._tier.listed(session))
            for key, holders in todo:
                blamed = self._fetch_one(session, key, holders, deadline)
                if blamed is not None:
                    failed[session] = frozenset(blamed)
                    break
        return Outcome(failed)

    def _fetch_one(
        self, session: str, key: PartKey, holders: tuple[int, ...], deadline: float
    ) -> set[int] | None:
        """Try each holder in turn: None once one delivered, else the holders to blame."""
        assert self._holdings is not None
        blamed: set[int] = set()
        for holder in holders:
            node = self._rnd.nodes[holder]
            nbytes = self._holdings[holder][session][key]
            timeout = min(self._settings.transfer_timeout(nbytes), deadline - time.monotonic())
            if timeout <= 0 or nbytes > self._settings.max_part_bytes:
                log.warning("checkpoint keeper: no time (or room) left to fetch %s", label(key))
                return blamed
            address = (node.host, node.peer_port)
            try:
                fetch_part(self._client, self._tier, address, session, key, nbytes, timeout)
            except (PeerError, PartRejectedError, CheckpointError) as exc:
                log.warning("checkpoint keeper: fetching %s of session %s from %s failed: %s",
                            label(key), session, node.node, exc)  # fmt: skip
                blamed.add(holder)
                continue
            except OSError as exc:  # this node's filesystem: another holder will not help
                log.warning("checkpoint keeper: cannot store %s here: %s", label(key), exc)
                return blamed
            self.fetched[session].add(node.node, nbytes)
            return None
        return blamed


def _log_fallbacks(prev: Decision, settled: Decision) -> None:
    """The decider says why the job restores less than it first chose."""
    if settled.aborted:
        log.warning("checkpoint keeper: restoring nothing: %s", settled.aborted)
        return
    for session, choice in sorted(settled.choices.items()):
        before = prev.choices.get(session)
        if before is not None and before.iteration != choice.iteration:
            log.warning("checkpoint keeper: session %s: iteration %d did not reach every node; "
                        "attempt %d restores %d%s", session, before.iteration, settled.attempt,
                        choice.iteration, f" ({choice.note})" if choice.note else "")  # fmt: skip
