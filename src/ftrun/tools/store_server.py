"""`ftrun store --port P`: a job's rendezvous store as its own process (the agents run with
`--ft-store-reconnect-timeout` and never serve it themselves, see `store.reconnecting`)."""

from __future__ import annotations

import datetime
import os
import signal

import click
from torch.distributed import TCPStore

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StoreServeError(Exception):
    """The port cannot be served (in use, not allowed)."""


def serve_until_signalled(port: int) -> signal.Signals:
    """Serve a TCPStore on `port` (all interfaces, as an agent serves it: libuv, several clients
    per process) until one of `STOP_SIGNALS`; returns the signal."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # for sigwait, never mid-call
    try:
        server = TCPStore(
            "0.0.0.0", port, is_master=True, multi_tenant=True,
            timeout=datetime.timedelta(seconds=60), wait_for_workers=False, use_libuv=True,
        )  # fmt: skip
    except RuntimeError as exc:
        raise StoreServeError(str(exc).strip().splitlines()[0]) from None
    click.echo(f"ftrun store: serving the rendezvous store on port {port} (pid {os.getpid()})")
    received = signal.Signals(signal.sigwait(STOP_SIGNALS))
    del server
    return received
