"""The checkpoint keeper, as a node service: the agent side of `ftrun.checkpointing.tier_files`.

- At start: the node's checkpoint directory (`tier`), the peer handlers (`transfer`) and the
  replicator thread (`replicator`). Every worker gets the directory as `FTRUN_CKPT_DIR`;
  parts there outlive worker restarts (nothing is removed when workers stop). `close` stops
  the thread (bounded) and removes the directory.
- `on_round`, after the rendezvous and before the workers start: the restore agreement
  (`restore`), then each session's `RESTORE_FILE` (`RestoreDecision`) written atomically, the
  restored iteration protected (`PROTECTED_FILE`), and the parts of the timeline the job left
  removed (`holdings.after_restore`). The replicator and pushes from peers pause meanwhile
  and resume for the new round.
- `on_stopped`, when the workers of a cycle are gone: one replication pass, so that what they
  saved just before exiting has its replicas before the next round's agreement.

A failing keeper never stops training: the thread logs and goes on; `on_round` never raises.
If the restore fails on this node (a store error, a bug), every session of this node gets a
`RESTORE_FILE` saying -1 and an ERROR line is logged, and this node tries to make the whole
job restore nothing too (the `final` key, see `restore`); its workers then start from scratch
or from their own files.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from torch.distributed import Store

from ftrun.checkpointing.keeper import holdings as plan
from ftrun.checkpointing.keeper.holdings import Decision
from ftrun.checkpointing.keeper.names import label
from ftrun.checkpointing.keeper.node_tier import DEFAULT_BASES, NodeTier
from ftrun.checkpointing.keeper.replicator import Replicator
from ftrun.checkpointing.keeper.restore import RestoreRun
from ftrun.checkpointing.keeper.settings import KeeperSettings
from ftrun.checkpointing.keeper.transfer import FETCH, PUSH, PartServer
from ftrun.checkpointing.store import PartKey
from ftrun.checkpointing.tier_files import RestoreDecision
from ftrun.environment import Env
from ftrun.peer import PeerClient, PeerServer
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService, ServiceContext

log = logging.getLogger("ftrun.agent")


class KeeperService(NodeService):
    name = "checkpoint keeper"

    def __init__(
        self,
        store: Store,
        run_id: str,
        server: PeerServer,
        client: PeerClient,
        emit: Callable[..., None],
        settings: KeeperSettings | None = None,
        bases: Sequence[Path] = DEFAULT_BASES,
    ) -> None:
        self._store = store
        self._run_id = run_id
        self._client = client
        self._emit = emit
        self._settings = settings or KeeperSettings()
        self.tier = NodeTier.create(run_id, bases)
        try:
            self._parts = PartServer(self.tier, self._settings)
            server.register(PUSH, self._parts.handle_push)
            server.register(FETCH, self._parts.handle_fetch)
            self.replicator = Replicator(self.tier, client, self._settings, emit).start()
        except BaseException:
            self.tier.close()
            raise

    def worker_env(self, rnd: Round) -> Mapping[str, str]:
        return {Env.CKPT_DIR: str(self.tier.root)}

    def on_round(self, rnd: Round) -> None:
        self._parts.cycle = None
        self.replicator.pause()
        try:
            self._restore(rnd)
        except Exception:  # the last resort: on_round never fails the agent
            log.exception("checkpoint keeper: restore bookkeeping failed")
        finally:
            try:
                self.replicator.resume(rnd)
            except Exception:
                log.exception("checkpoint keeper: replication stays off this round")
            self._parts.cycle = rnd.number

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        """The workers are gone: replicate what they saved last before the next round (a
        part written just before an exit, such as a re-run's checkpoint, would otherwise be
        left to the next poll, after the restore agreement that needs it)."""
        try:
            self.replicator.tick()
        except Exception as exc:
            log.warning("checkpoint keeper: replicating the last parts failed: %r", exc)

    def close(self) -> None:
        self._parts.cycle = None
        self.replicator.stop()
        self.tier.close()

    def _report_set_aside(self) -> None:
        """A worker refused a part of this node (its checksum failed): say so once; the
        restore below then takes a replica from a peer or an older iteration."""
        for session in self.tier.sessions():
            for key in self.tier.take_set_aside(session):
                log.warning("checkpoint keeper: a worker found %s of session %s corrupt",
                            label(key), session)  # fmt: skip
                self._emit("ckpt_corrupt", session=session, iteration=key.iteration,
                           rank=key.rank, world_size=key.world_size)  # fmt: skip

    def _restore(self, rnd: Round) -> None:
        self._report_set_aside()
        started = time.monotonic()
        run = RestoreRun(self._store, self._run_id, rnd, self.tier, self._client, self._settings)
        try:
            self.tier.clear_restore()
            decision = run.run()
        except Exception as exc:
            log.error("checkpoint keeper: restore failed (%s): the workers of this node restore "
                      "nothing", exc, exc_info=True)  # fmt: skip
            with contextlib.suppress(Exception):
                run.abort(f"restore failed: {exc}")
            for session in self.tier.sessions():
                self.tier.write_restore(session, RestoreDecision(-1, rnd.world_size))
            return
        seconds = round(time.monotonic() - started, 6)
        if decision.aborted:
            log.error("checkpoint keeper: the job restores nothing: %s", decision.aborted)
        for session in sorted(set(decision.choices) | set(self.tier.sessions())):
            iteration = self._apply(rnd, session, decision)
            got = run.fetched[session]  # a `Fetched` of nothing where nothing was fetched
            self._emit("ckpt_restore", session=session, iteration=iteration,
                       world_size=rnd.world_size, fetched=got.parts, sources=got.sources,
                       bytes=got.bytes, seconds=seconds, attempts=run.attempts)  # fmt: skip

    def _apply(self, rnd: Round, session: str, decision: Decision) -> int:
        """Write the session's decision and drop the parts it leaves behind; the iteration."""
        choice = decision.choice(session, rnd.world_size)
        mine = range(rnd.first_global_rank, rnd.first_global_rank + rnd.me.local_world_size)
        wanted = [PartKey(choice.iteration, r, choice.world_size) for r in mine]
        missing = (
            []
            if choice.iteration < 0
            else [k.rank for k in wanted if not self.tier.has(session, k)]
        )
        if missing:  # cannot happen when every node follows the protocol: say so loudly
            log.error("checkpoint keeper: session %s: iteration %d was agreed but ranks %s "
                      "have no part here: they restore nothing", session, choice.iteration,
                      missing)  # fmt: skip
            self.tier.write_restore(session, RestoreDecision(-1, rnd.world_size))
            return -1
        self.tier.write_restore(session, RestoreDecision(choice.iteration, choice.world_size))
        # Complete for every rank and now on this node for its ranks: kept until the
        # replicator finds a newer iteration held whole here.
        self.tier.write_protected(session, choice.iteration, choice.world_size)
        doomed = plan.after_restore(self.tier.listed(session), choice, self._settings.keep_complete)
        self.tier.remove(session, doomed)
        it = choice.iteration
        what = f"iteration {it}" if it >= 0 else f"nothing: {choice.note}"
        log.info("checkpoint keeper: session %s restores %s", session, what)
        return choice.iteration


def keeper_service(context: ServiceContext) -> KeeperService:
    """The `ServiceFactory` the builder hands the agent."""
    run_id = context.config.rendezvous.run_id
    return KeeperService(
        context.store, run_id, context.peer_server, context.peer_client, context.emit
    )
