"""The keeper's knobs: every wait and every transfer is bounded by one of these."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KeeperSettings:
    """Bounds and retention of the checkpoint keeper (defaults are for real jobs)."""

    keep_complete: int = 2
    """Complete parts kept per (rank, world size) among replicas, the newest ones. Two, as the
    worker's manager keeps by default: with one, a node that dies right after its ranks
    finished iteration k (and peers dropped their copies of k-1) while other ranks were still
    writing k would leave no iteration complete for every rank."""
    poll_s: float = 0.05
    """How often the replicator lists the directory for new parts (names only). With a
    snapshot every step (`StepSnapshot`), a lost node redoes the steps its replicas lag
    behind: this poll, plus the push."""
    gather_s: float = 30.0
    """Longest wait for the other nodes' messages in the store (holdings, decisions)."""
    fetch_s: float = 120.0
    """Longest time one node spends on one restore attempt's fetches, all parts together."""
    attempts: int = 3
    """Restore attempts (iterations tried) before the job restores nothing."""
    transfer_base_s: float = 10.0
    min_rate: float = 100e6
    """Bytes/s a transfer must at least reach: a part of n bytes may take
    `transfer_base_s + n / min_rate` seconds."""
    max_part_bytes: int = 256 << 30
    """Largest part a peer may push or a fetch may bring (also bounded by free space)."""
    free_reserve_bytes: int = 64 << 20
    """Left free in the directory's filesystem after a received part."""

    def transfer_timeout(self, nbytes: int) -> float:
        return self.transfer_base_s + nbytes / self.min_rate
