"""Barrier rendezvous (v3): O(1) store writes per node per round, one bulk read, hot spares.

Round `c` (the job's cycle number, see `control`): each node `add`s itself to `c<c>/arrivals`
(its arrival index), writes its descriptor to `c<c>/node/<index>` and waits on `c<c>/closed`.
A closer decides who takes which slot (`slots.plan_round`: the previous round's nodes keep
their group ranks, spares fill the slots of nodes that are gone, extra nodes stand by) and
publishes it by `compare_set`ting `closed` to it, as one value (`published.PublishedRound`):
the first close wins, and each node does one `get` of ~10 bytes per node instead of N key reads
(O(N^2) work per round made 1024 nodes slow), and no second read for where the round is.

Who closes: the arrival that fills `max_nodes` tries at once (the common case: everyone is
back); the first arrival (the *planner*) looks again every second, probing the previous
round's nodes that have not come back (`probe`: a dead agent's peer channel does not answer)
and closing on the last call (`--nnodes=MIN:MAX`, or an owner that is late). If the planner
dies, the others see its beat stop and take over. A node that dies between its arrival and its
descriptor write is simply not a candidate: the closer waits for missing descriptors only
`DESCRIPTOR_GRACE_S`, never the store's timeout.

Nodes not in the round stand by: they wait for the cycle to end and arrive at the next round,
and leave with the job's code when it ends (the job's last node to finish shuts it down).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ftrun.config.rendezvous import RendezvousConfig
from ftrun.errors import ExitCode, NodeExcludedError
from ftrun.rendezvous.control import Shutdown, job_control
from ftrun.rendezvous.errors import DescriptorVersionError, JoinInterruptedError
from ftrun.rendezvous.published import Progress, PublishedRound, reported_iteration
from ftrun.rendezvous.ranks import NodeDescriptor, Round, infra_rank_error, row_from_json
from ftrun.rendezvous.slots import Arrival, RoundView, plan_round, standbys
from ftrun.store.ops import (
    add_then_wait_on,
    existing_keys,
    get_if_exists,
    get_within,
    wait_for_keys,
    waits_are_requests,
)

log = logging.getLogger("ftrun.rendezvous")

BACKEND = "ftrun-barrier"
_WAIT_CHUNK_S = 1.0
"""How often a waiting node looks at its signals (the store: `_POLL_EVERY`); on a store whose
waits are requests (etcd), a node that does not plan waits `_POLL_EVERY` of them in one."""
DESCRIPTOR_GRACE_S = 5.0
"""How long the filling arrival waits for a descriptor of a node that arrived: a live node
writes it one store round trip after arriving; seconds cover a loaded store and GIL stalls."""
_POLL_EVERY = 3
"""A waiting node that does not plan looks at the store (shutdown, arrivals, the unhealthy,
the planner's beat) every this many chunks, and otherwise only waits for the close: N waiting
nodes poll a third as often, which is what loads an etcd store at 1,000 nodes and more."""
_TAKEOVER_S = DESCRIPTOR_GRACE_S + (_POLL_EVERY + 2) * _WAIT_CHUNK_S
"""A planner beat unchanged this long: the planner is gone, every waiting node plans."""

Probe = Callable[[NodeDescriptor], bool]
"""Whether the agent behind a descriptor still answers (its peer channel); False: gone."""


@dataclasses.dataclass
class _Planning:
    """What one node learned about an open round, kept between its passes."""

    cycle: int
    rows: dict[int, list[object]] = dataclasses.field(default_factory=dict)
    """Descriptor rows by arrival index (descriptors never change once written)."""
    previous: PublishedRound | None = None
    gone: set[str] = dataclasses.field(default_factory=set)
    gone_unhealthy: set[str] = dataclasses.field(default_factory=set)
    """Those of `gone` that reported themselves unhealthy (already in the unhealthy count)."""
    min_since: float | None = None
    beat: tuple[int, float] = (-1, 0.0)
    """The planner's beat as last seen, and when it last changed."""


class BarrierRendezvousHandler(RendezvousHandler):
    """torch's RendezvousHandler on the barrier algorithm; `join` is what the agent calls."""

    def __init__(
        self,
        config: RendezvousConfig,
        store: Store,
        descriptor: Callable[[], NodeDescriptor],
        probe: Probe | None = None,
        on_standby: Callable[[int, tuple[str, ...]], None] | None = None,
        descriptor_grace: float = DESCRIPTOR_GRACE_S,
    ) -> None:
        self._config = config
        self._store = store
        self.control = job_control(store, config.run_id)
        self._prefix = self.control.prefix
        self._descriptor = descriptor
        self._probe = probe
        self._on_standby = on_standby
        self._grace = descriptor_grace
        self._long_wait = _POLL_EVERY if waits_are_requests(store) else 1
        """Wait chunks in one wait for a node that does not plan: on etcd, where a wait is a
        watch request, one per look, not one a second."""
        self._closed_size = (-1, 0)
        """(cycle, size) of the last closed round `num_nodes_waiting` looked at."""
        self._arrived_at = 0.0
        """When this node last arrived at a round (monotonic): a standby node's wait for earlier
        cycles to end is not its rendezvous time."""
        self._last_published: tuple[int, bytes] | None = None
        """(cycle, round) of the last closed round this node read, for `restore`."""

    # ---- torch's RendezvousHandler -------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        rnd = self.join(lambda: False)
        return RendezvousInfo(
            store=PrefixStore(f"{self._prefix}/c{rnd.number}/workers", self._store),
            rank=rnd.group_rank,
            world_size=len(rnd.nodes),
            bootstrap_store_info=RendezvousStoreInfo(rnd.master.host, rnd.master.master_port),
        )

    def is_closed(self) -> bool:
        return self.control.shutdown_requested() is not None

    def set_closed(self) -> None:
        self.control.shutdown(ExitCode.SUCCESS, "rendezvous closed", self.control.cycle())

    def num_nodes_waiting(self, cycle: int | None = None) -> int:
        """Nodes that arrived at round `cycle` (default: the current one) but are not in it
        (standby nodes; candidates for a scale-up while the round is below `max_nodes`)."""
        cycle = self.control.cycle() if cycle is None else cycle
        closed = self._key(cycle, "closed")
        if not self._store.check([closed]):
            return 0
        if self._closed_size[0] != cycle:  # a closed round never changes: read its blob once
            self._closed_size = (cycle, len(self._published(cycle).indices))
        return max(0, self._store.add(self._key(cycle, "arrivals"), 0) - self._closed_size[1])

    def get_run_id(self) -> str:
        return self._config.run_id

    def shutdown(self) -> bool:
        return True

    # ---- the algorithm ---------------------------------------------------------------------

    def join(self, interrupted: Callable[[], bool]) -> Round:
        """Take part in the current round (or a later one, standing by); raises on timeout or
        shutdown."""
        deadline = time.monotonic() + self._config.join_timeout
        while True:
            shutdown, cycle = self.control.shutdown_and_cycle()
            _raise_for(shutdown)
            # Built before arriving: a closer gives an arrival only a short grace to write it.
            mine = self._descriptor().to_json()
            self._arrived_at = time.monotonic()
            arrivals, closed = self._key(cycle, "arrivals"), self._key(cycle, "closed")
            index = add_then_wait_on(self._store, arrivals, closed) - 1
            self._store.set(self._key(cycle, f"node/{index}"), mine)
            planning = _Planning(cycle)
            if index + 1 >= self._config.max_nodes:  # the filler, or a spare after it
                self._plan_and_close(planning, self._grace, probe=False)
            blob = self._await_close(planning, index, deadline, interrupted)
            published = self._published(cycle, blob)
            rnd = published.round_for(cycle, index)
            if rnd is not None:
                return dataclasses.replace(rnd, arrived_at=self._arrived_at)
            log.info("round %d closed without this node: standing by for the next", cycle)
            if self._on_standby is not None:
                self._on_standby(cycle, tuple(n.node for n in published.nodes()))
            self._await_next(cycle, deadline, interrupted)

    def _await_close(
        self, planning: _Planning, index: int, deadline: float, interrupted: Callable[[], bool]
    ) -> bytes:
        """The round's published value, once a closer has set it (waiting in chunks, with the
        planner's and the others' looks at the round between them)."""
        cycle = planning.cycle
        closed = self._key(cycle, "closed")
        is_planner = index == 0
        # Signals are then seen at the look, within 3 s: a rendezvous has no workers whose
        # checkpoint they would delay.
        per_wait = 1 if is_planner else self._long_wait
        chunks = 0
        while (blob := get_within(self._store, closed, per_wait * _WAIT_CHUNK_S)) is None:
            chunks += per_wait
            if not is_planner and chunks % _POLL_EVERY:  # the close itself ends the wait
                self._check_waiting(deadline, interrupted, ask_store=False)
                continue
            if interrupted():
                raise JoinInterruptedError
            # One request on etcd (`read_now`): shutdown, the counts, the planner's beat.
            counters = ["arrivals", "unhealthy", *([] if is_planner else ["beat"])]
            shutdown, counts = self.control.shutdown_and_counts(
                [self._key(cycle, name) for name in counters]
            )
            _raise_for(shutdown)
            self._check_waiting(deadline, interrupted, ask_store=False)
            self.control.healthy_capacity(
                cycle, self._config.min_nodes, self._config.max_nodes, counts[0], counts[1]
            )
            if is_planner or self._planner_gone(planning, counts[2]):
                self._store.add(self._key(cycle, "beat"), 1)
                self._plan_and_close(planning, 0.0, probe=True)
        return blob

    def _planner_gone(self, planning: _Planning, beat: int) -> bool:
        now = time.monotonic()
        if beat != planning.beat[0]:
            planning.beat = (beat, now)
        return now - planning.beat[1] >= _TAKEOVER_S

    def _plan_and_close(self, planning: _Planning, grace: float, probe: bool) -> None:
        """Look at the round once; close it if it is decided (the first close wins)."""
        cycle = planning.cycle
        if self._store.check([self._key(cycle, "closed")]):
            return
        self._read_arrivals(planning, grace)
        arrivals = tuple(Arrival.from_row(i, row) for i, row in sorted(planning.rows.items()))
        if len(arrivals) >= self._config.min_nodes and planning.min_since is None:
            planning.min_since = time.monotonic()
        if cycle > 0 and planning.previous is None:
            planning.previous = self._published_or_none(cycle - 1)
        view = self._view(planning, arrivals, probe)
        use_infra = self._config.use_infra_group_rank and planning.previous is None
        error = infra_rank_error(planning.rows.values(), use_infra)
        chosen = arrivals if error else plan_round(view)
        if chosen is None:
            return
        spares = standbys(arrivals, chosen, view.by_infra, view.aside)
        published = PublishedRound(rows=tuple(planning.rows[a.index] for a in chosen),
                                   indices=tuple(a.index for a in chosen),
                                   standby=tuple(a.node for a in spares),
                                   progress=self._progress(planning), error=error)  # fmt: skip
        self._store.compare_set(self._key(cycle, "closed"), "", published.encode())

    def _view(self, planning: _Planning, arrivals: tuple[Arrival, ...], probe: bool) -> RoundView:
        config, previous = self._config, planning.previous
        owners: tuple[str | int, ...] = ()
        if previous is not None:
            owners = tuple(str(row[1]) for row in previous.rows)  # node names, in slot order
        elif config.use_infra_group_rank:
            owners = tuple(range(config.max_nodes))
        unhealthy = self._store.add(self._key(planning.cycle, "unhealthy"), 0)
        if probe and previous is not None:
            self._find_gone(planning, {a.node for a in arrivals})
        waited = planning.min_since is not None and (
            time.monotonic() - planning.min_since >= config.last_call_timeout
        )
        capacity = config.max_nodes - unhealthy - len(planning.gone - planning.gone_unhealthy)
        aside = self.control.stepped_aside(planning.cycle) if previous is not None else frozenset()
        return RoundView(max_nodes=config.max_nodes, min_nodes=config.min_nodes, arrivals=arrivals,
                         owners=owners, by_infra=config.use_infra_group_rank,
                         gone=frozenset(planning.gone), capacity=capacity, last_call_over=waited,
                         aside=aside)  # fmt: skip

    def _find_gone(self, planning: _Planning, arrived: set[str]) -> None:
        """Previous members not back yet that left, reported themselves unhealthy, or whose
        agent no longer answers."""
        assert planning.previous is not None
        for row in planning.previous.rows:
            node = str(row[1])
            if node in arrived or node in planning.gone:
                continue
            if self._store.check([self.control.unhealthy_key(planning.cycle, node)]):
                planning.gone_unhealthy.add(node)
            flagged = node in planning.gone_unhealthy or self._store.check(
                [self.control.gone_key(node)]
            )
            if flagged or (self._probe is not None and not self._answers(row)):
                log.warning("round %d: node %s of the last round is gone; its slot goes to a "
                            "standby node if there is one", planning.cycle, node)  # fmt: skip
                planning.gone.add(node)

    def _answers(self, row: list[object]) -> bool:
        try:
            descriptor = NodeDescriptor.from_row(row)
        except DescriptorVersionError:
            return False
        return descriptor.peer_port == 0 or bool(self._probe and self._probe(descriptor))

    def _read_arrivals(self, planning: _Planning, grace: float) -> None:
        """Read the descriptors not read yet (one multi_get), after up to `grace` for them."""
        cycle = planning.cycle
        count = self._store.add(self._key(cycle, "arrivals"), 0)
        unread = {self._key(cycle, f"node/{i}"): i for i in range(count) if i not in planning.rows}
        keys = list(unread)
        if not wait_for_keys(self._store, keys, grace):
            keys = existing_keys(self._store, keys)
        if keys:
            # Foreign-version descriptors are published too: every participant refuses them.
            for key, raw in zip(keys, self._store.multi_get(keys), strict=True):
                planning.rows[unread[key]] = row_from_json(raw)

    def _progress(self, planning: _Planning) -> Progress:
        previous = planning.previous
        if previous is None:
            return Progress()
        keys = [self.control.progress_key(planning.cycle - 1, str(r[1])) for r in previous.rows]
        present = existing_keys(self._store, keys)
        raws = self._store.multi_get(present) if present else []
        return previous.progress.after([reported_iteration(raw) for raw in raws])

    def _published(self, cycle: int, blob: bytes | None = None) -> PublishedRound:
        """Round `cycle` as its closer published it (`blob`: its value, already read)."""
        if blob is None:
            blob = self._store.get(self._key(cycle, "closed"))
        if self._last_published is None or self._last_published[0] <= cycle:
            self._last_published = (cycle, blob)
        return PublishedRound.decode(blob)

    def restore(self) -> None:
        """Publish again the last round this node saw, in a store that restarted empty: the
        next round then keeps its nodes in their slots (and spares in the slots of the gone)."""
        if self._last_published is None:
            return
        cycle, blob = self._last_published
        self._store.compare_set(self._key(cycle, "closed"), "", blob)

    def _published_or_none(self, cycle: int) -> PublishedRound | None:
        blob = get_if_exists(self._store, self._key(cycle, "closed"))
        return None if blob is None else self._published(cycle, blob)

    def _await_next(self, cycle: int, deadline: float, interrupted: Callable[[], bool]) -> None:
        """A standby node's wait through a cycle (hours): on etcd, a look every 3 s (a watch and
        two reads), not every second."""
        while not self.control.wait_restart(cycle, self._long_wait * _WAIT_CHUNK_S):
            self._raise_if_excluded()
            self._check_waiting(deadline, interrupted)
        self._raise_if_excluded()  # before the shutdown that may have ended the wait

    def _raise_if_excluded(self) -> None:
        """A standby node excluded while it waited (a re-run found it faulty) leaves with 5,
        also when the job ended meanwhile: the exclusion was said first."""
        reason = get_if_exists(self._store, self.control.gone_key(self._descriptor().node))
        if reason is not None:
            raise NodeExcludedError(f"excluded while standing by: {reason.decode()}")

    def _check_waiting(
        self, deadline: float, interrupted: Callable[[], bool], ask_store: bool = True
    ) -> None:
        """A signal, a shutdown of the job (`ask_store`: the one check that is a store read),
        the join timeout."""
        if interrupted():
            raise JoinInterruptedError
        if ask_store:
            _raise_for(self.control.shutdown_requested())
        if time.monotonic() >= deadline:
            raise RendezvousTimeoutError(
                f"rendezvous did not complete within join_timeout={self._config.join_timeout}s "
                f"(need {self._config.min_nodes} node(s))"
            )

    def _key(self, cycle: int, name: str) -> str:
        return f"{self._prefix}/c{cycle}/{name}"


def _raise_for(shutdown: Shutdown | None) -> None:
    """The job is shut down (as the store said): this node leaves the rendezvous."""
    if shutdown is not None:
        raise RendezvousClosedError(shutdown.reason)
