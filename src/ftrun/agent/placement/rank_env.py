"""The rank variables of one worker, as torchrun 2.13 sets them (with `--virtual-local-rank`).

torchrun (`LocalElasticAgent._set_local_rank_env`): normally `LOCAL_RANK` is the local rank and
the worker inherits the launcher's `CUDA_VISIBLE_DEVICES`. With `--virtual-local-rank` every
worker gets `LOCAL_RANK=0` and `CUDA_VISIBLE_DEVICES` naming only its own GPU: entry
`local_rank` of the launcher's `CUDA_VISIBLE_DEVICES` list when that is set, else `local_rank`
itself. So `torch.device("cuda", LOCAL_RANK)` is that GPU in every worker.
"""

from __future__ import annotations


def visible_device(local_rank: int, parent_visible_devices: str | None) -> str:
    """The one GPU a worker sees under `--virtual-local-rank`; `ValueError` if there is none.

    `parent_visible_devices` is the launcher's `CUDA_VISIBLE_DEVICES` (None: unset), split on
    commas exactly as torch splits it (so `""` is one empty entry).
    """
    if parent_visible_devices is None:
        return str(local_rank)
    available = parent_visible_devices.split(",")
    if local_rank >= len(available):
        raise ValueError(
            f"local rank {local_rank} has no GPU in CUDA_VISIBLE_DEVICES={parent_visible_devices}"
        )
    return available[local_rank].strip()


def rank_variables(
    local_rank: int, rank: int, virtual_local_rank: bool, parent_visible_devices: str | None = None
) -> dict[str, str]:
    """The per-worker variables: `LOCAL_RANK`, `RANK`, `ROLE_RANK` (= `RANK`: one role), plus
    `CUDA_VISIBLE_DEVICES` under `virtual_local_rank` (see `visible_device`).

    Without `virtual_local_rank`, `CUDA_VISIBLE_DEVICES` is not returned: the worker keeps the
    launcher's, as with torchrun.
    """
    variables = {
        "LOCAL_RANK": "0" if virtual_local_rank else str(local_rank),
        "RANK": str(rank),
        "ROLE_RANK": str(rank),
    }
    if virtual_local_rank:
        variables["CUDA_VISIBLE_DEVICES"] = visible_device(local_rank, parent_visible_devices)
    return variables
