"""The coordination store of the wrapped ranks: where it lives, and NVRx's store names.

Under `ft_launcher` the agents serve it (`Env.INPROCESS_STORE`, `host:port`, and
`Env.INPROCESS_PREFIX`, this cycle's keys): it outlives any rank's process, so even rank 0 can
be lost and replaced in-process, and the agents write their own interruptions into it (a hang
verdict, a lost process). Standalone (`torchrun`, or no launcher) it is NVRx's arrangement: a
`TCPStore` on `MASTER_ADDR` that rank 0 serves at `store_kwargs["port"]` (NVRx's examples pass
`MASTER_PORT + 1`), or, where that port is taken (torchrun's own store on `MASTER_PORT`), a
client of the store already there.
"""

from __future__ import annotations

import datetime
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ftrun.environment import Env

log = logging.getLogger("ftrun.inprocess")

STANDALONE_PREFIX = "ftrun-inprocess"
_TIMEOUT = datetime.timedelta(seconds=300)


class StoreMixin:
    """NVRx's marker base of the stores a `Wrapper(store_factory=...)` accepts."""


class TCPStore(dist.TCPStore, StoreMixin):
    """NVRx's `inprocess.store.TCPStore`: `MASTER_ADDR`/`MASTER_PORT`/`WORLD_SIZE` by default;
    rank 0 serves it, or joins the one already serving the port."""

    def __init__(self, host_name: str | None = None, port: int | None = None,
                 world_size: int | None = None, timeout: datetime.timedelta = _TIMEOUT,
                 wait_for_workers: bool = True, multi_tenant: bool = False,
                 use_libuv: bool = True) -> None:  # fmt: skip
        host = host_name or os.environ["MASTER_ADDR"]
        port = int(port if port is not None else os.environ["MASTER_PORT"])
        world = int(world_size if world_size is not None else os.environ["WORLD_SIZE"])
        common: dict[str, Any] = dict(timeout=timeout, multi_tenant=multi_tenant,
                                      use_libuv=use_libuv)  # fmt: skip
        if int(os.environ.get("RANK", "0")) == 0:
            try:
                super().__init__(host, port, world, True, wait_for_workers=False, **common)
                return
            except (RuntimeError, OSError) as error:  # the port is served already
                # torchrun's own store on MASTER_PORT is the usual one; another port in use is
                # worth a line: a listener that is not a store leaves every rank validating.
                usual = str(port) == os.environ.get("MASTER_PORT")
                level = logging.DEBUG if usual else logging.WARNING
                log.log(level, "in-process store: %s:%d is in use (%s); joining whoever serves "
                        "it", host, port, error)  # fmt: skip
        super().__init__(host, port, world, False, **common)


class PrefixStore(dist.PrefixStore, StoreMixin):
    """NVRx's name for a store under a key prefix."""


def prefix(environ: dict[str, str]) -> str:
    """The key prefix of this cycle's coordination (the launcher's, else the standalone one)."""
    return environ.get(Env.INPROCESS_PREFIX, STANDALONE_PREFIX)


def connect(
    factory: Callable[..., dist.Store], kwargs: dict[str, Any], environ: dict[str, str]
) -> tuple[dist.Store, Callable[[], dist.Store], str]:
    """The coordination store (under its prefix), a maker of more connections to it (the
    watcher blocks on its own), and its `host:port`."""
    address = environ.get(Env.INPROCESS_STORE)  # the agents' store, under ft_launcher
    if not address:
        base = factory(**kwargs)
        address = f"{base.host}:{base.port}" if isinstance(base, dist.TCPStore) else ""
        return (dist.PrefixStore(STANDALONE_PREFIX, base),
                lambda: dist.PrefixStore(STANDALONE_PREFIX, base.clone()), address)  # fmt: skip
    if kwargs or factory is not TCPStore:
        warnings.warn("ftrun.inprocess.Wrapper: store_factory/store_kwargs are not used under "
                      "ft_launcher: the ranks coordinate through the job's store",
                      stacklevel=4)  # fmt: skip
    host, _, port = address.rpartition(":")
    keys = prefix(environ)

    def client() -> dist.Store:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=_TIMEOUT, use_libuv=True)
        return dist.PrefixStore(keys, store)

    return client(), client, address
