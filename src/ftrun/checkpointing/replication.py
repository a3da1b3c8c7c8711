"""Which ranks hold copies of which parts: NVRx's clique replication, as pure arithmetic.

NVRx's `CliqueReplicationStrategy` splits the W training ranks into cliques of F ranks
(F = `replication_factor`) spaced J apart (J = `replication_jump`):

    n, n + J, n + 2J, ..., n + (F - 1)J      with n = a*J*F + b, 0 <= b < J

and every rank of a clique keeps every other member's part. Set J to the number of ranks that
one failure takes down (ranks per node, NVRx's default being the GPU count) so that the copies
sit on other nodes. W must be a multiple of J*F.

Here the strategies only hold the parameters and answer `clique_of`: the copying itself is the
checkpoint keeper's, in the node agent under ft_launcher (`keeper.replicator`), and never done
under plain torchrun. No process group is created, so the lazy variant is the same thing by another
name (NVRx's delays creating process groups).
"""

from __future__ import annotations

from ftrun.checkpointing.errors import CheckpointUsageError


class CliqueReplicationStrategy:
    """Copies of each part on the F ranks of its clique; see the module docstring.

    Example, 32 ranks, `replication_jump=8`, `replication_factor=2`: the cliques are
    (0, 8), (1, 9), ..., (7, 15), (16, 24), (17, 25), ..., (23, 31), so
    `clique_of(17, 32) == (17, 25)`.
    """

    def __init__(self, replication_jump: int = 1, replication_factor: int = 2) -> None:
        self.replication_jump = _positive("replication_jump", replication_jump)
        self.replication_factor = _positive("replication_factor", replication_factor)

    @classmethod
    def from_replication_params(
        cls, replication_jump: int = 1, replication_factor: int = 2
    ) -> CliqueReplicationStrategy:
        """NVRx's constructor name (it also builds process groups; this does not)."""
        return cls(replication_jump, replication_factor)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(replication_jump={self.replication_jump}, "
            f"replication_factor={self.replication_factor})"
        )

    def clique_of(self, rank: int, world_size: int) -> tuple[int, ...]:
        """The ranks holding copies of `rank`'s part, `rank` included, ascending."""
        jump, factor = self.replication_jump, self.replication_factor
        self.check_world_size(world_size)
        if type(rank) is not int or not 0 <= rank < world_size:
            raise CheckpointUsageError(f"rank {rank!r} is not in 0..{world_size - 1}")
        block = jump * factor  # ranks a*J*F .. (a+1)*J*F - 1 form J cliques
        first = rank // block * block + rank % jump
        return tuple(first + i * jump for i in range(factor))

    def check_world_size(self, world_size: int) -> None:
        """Raise `CheckpointUsageError` unless `world_size` splits into whole cliques."""
        block = self.replication_jump * self.replication_factor
        if type(world_size) is not int or world_size < 1 or world_size % block:
            raise CheckpointUsageError(
                f"cannot split {world_size!r} ranks into cliques of {self.replication_factor} "
                f"ranks spaced {self.replication_jump} apart: the world size must be a "
                f"multiple of replication_jump * replication_factor = {block}"
            )


class LazyCliqueReplicationStrategy(CliqueReplicationStrategy):
    """NVRx's lazy variant: the same parameters and arithmetic (there is nothing to delay)."""


def _positive(name: str, value: int) -> int:
    if type(value) is not int or value < 1:
        raise CheckpointUsageError(f"{name} must be an int >= 1, not {value!r}")
    return value
