"""The job's c10d TCPStore: served by the agent on the endpoint host, reached by the others."""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ftrun.aside import Aside
from ftrun.config.store import StoreConfig
from ftrun.errors import RendezvousAuthError, RendezvousFailedError, RendezvousPrefixHeldError
from ftrun.identity import is_local_host
from ftrun.store.etcd_lease import JOB_LEASE_TTL_S, LEASE_KEY, JobLease
from ftrun.store.etcd_members import MemberHealth, spread_start
from ftrun.store.reconnecting import ReconnectingStore

if TYPE_CHECKING:  # etcd3gw is an extra: imported where an etcd store is made
    from ftrun.store.etcd_store import EtcdStore

log = logging.getLogger("ftrun.rendezvous")

DEFAULT_PORT = 29400
OWNER_KEY = "owner"
"""etcd only: the Slurm job id of the launch that claimed the job's key prefix."""
# Store errors (timeouts, lost connections) surface as these; DistStoreError is a RuntimeError.
STORE_ERRORS = (RuntimeError, TimeoutError, ValueError)
_HANDSHAKE_SLACK_S = 1.0
_LISTEN_POLL_S = 0.05


def connect_store(
    config: StoreConfig,
    may_host: bool = True,
    environ: Mapping[str, str] | None = None,
    interrupted: Callable[[], bool] = lambda: False,
) -> tuple[Store, bool]:
    """Serve the store if this machine is the endpoint host and the port is free, else connect.

    Several agents on one machine (tests, or one node running several launchers) race for the
    port: the first one serves, the others fall back to being clients, as torchrun does. With
    `--rdzv-backend=etcd` no agent serves anything: the store is the etcd cluster (`environ`
    says which Slurm job and restart this launcher belongs to, see `connect_etcd`). With a
    reconnect window (`--ft-store-reconnect-timeout`) no agent serves either: `ftrun store` does,
    and a wait for it to come back gives up once `interrupted()` (a signal: preemption must not
    wait for the window).
    """
    timeout = config.timeout
    if config.backend == "etcd":
        return connect_etcd(config.endpoint, config.run_id, timeout, environ or {}), False
    host, port = parse_rendezvous_endpoint(config.endpoint, default_port=DEFAULT_PORT)
    if config.reconnect_timeout > 0:
        window = config.reconnect_timeout
        return _connect_external(host, port, timeout, window, interrupted), False
    try_host = may_host and (config.is_host if config.is_host is not None else is_local_host(host))
    attempts = [True, False] if try_host else [False]
    if config.is_host and may_host:
        attempts = [True]
    last_error: Exception | None = None
    for serve in attempts:
        try:
            store = _open_store(host, port, serve, timeout)
        except STORE_ERRORS as exc:
            last_error = exc
            continue
        if serve:
            log.info("serving the rendezvous store on %s:%d", host, store.port)
        return store, serve
    raise RendezvousFailedError(
        f"cannot reach the rendezvous store at {host}:{port}: {_one_line(last_error)}"
    )


def another_client(
    store: Store,
    config: StoreConfig,
    environ: Mapping[str, str],
    timeout: datetime.timedelta | None = None,
) -> Store:
    """A client of the same store with a connection of its own, for a thread that blocks in
    waits (a blocking request holds its connection): on etcd another `EtcdStore`; else a plain
    TCPStore client at the store's real address (with --standalone the endpoint says port 0),
    which never serves and never reconnects (`ftrun store`'s restarts are the agent's own
    client's business: the thread's caller connects again). `timeout`: its requests' bound
    (default: the store's)."""
    timeout = timeout or config.timeout
    if config.backend == "etcd":  # sharing what the store's client saw, and its lease
        shared = (getattr(store, "health", None), getattr(store, "lease", None))
        return connect_etcd(config.endpoint, config.run_id, timeout, environ, shared)
    if isinstance(store, TCPStore):
        host, port = store.host, store.port
    else:  # `ftrun store`'s, which the agent reaches through a ReconnectingStore
        host, port = parse_rendezvous_endpoint(config.endpoint, default_port=DEFAULT_PORT)
    return _open_store(host, port, False, timeout)


def _connect_external(
    host: str,
    port: int,
    timeout: datetime.timedelta,
    window: float,
    interrupted: Callable[[], bool],
) -> ReconnectingStore:
    """A client of the store `ftrun store` serves (no agent serves it), that comes through a
    restart of that process: see `reconnecting`."""

    def connect(seconds: float) -> Store:
        deadline = time.monotonic() + seconds
        _await_listening(host, port, deadline, interrupted)
        left = max(deadline - time.monotonic(), _HANDSHAKE_SLACK_S)
        return _open_store(host, port, False, datetime.timedelta(seconds=left))

    try:
        client = connect(timeout.total_seconds())
    except STORE_ERRORS as exc:
        raise RendezvousFailedError(
            f"cannot reach the rendezvous store at {host}:{port} (is `ftrun store --port {port}`"
            f" running there?): {_one_line(exc)}"
        ) from None
    log.info("the rendezvous store is at %s:%d, served by ftrun store", host, port)
    return ReconnectingStore(client, connect, window, f"{host}:{port}")


def _await_listening(
    host: str, port: int, deadline: float, interrupted: Callable[[], bool]
) -> None:
    """Until something accepts connections at host:port, or `deadline`: TCPStore's own connect
    retry backs off to seconds between tries, this looks every `_LISTEN_POLL_S`. Raises
    TimeoutError at once when `interrupted()`."""
    while time.monotonic() < deadline:
        if interrupted():
            raise TimeoutError("gave up waiting for the store: the launcher got a signal")
        try:
            with socket.create_connection((host, port), timeout=_LISTEN_POLL_S * 10):
                return
        except OSError:
            time.sleep(_LISTEN_POLL_S)


def connect_etcd(
    endpoint: str,
    run_id: str,
    timeout: datetime.timedelta,
    environ: Mapping[str, str],
    shared: tuple[MemberHealth | None, JobLease | None] = (None, None),
    lease_ttl_s: float | None = None,
) -> Store:
    """The job's store on the etcd members `endpoint` names (`host:port,...`), answering now;
    `shared`: what the launcher's first client saw of the members (`MemberHealth`) and the
    launch's lease (`etcd_lease`; None: this client finds or grants it, of `lease_ttl_s`).

    etcd outlives jobs: its keys for this launch go under `<run id>/<Slurm restart count>`, so
    that a requeued job (same job id) does not find its previous run's rounds. Under Slurm the
    first launcher also claims that prefix for its Slurm job: a launcher of another job with the
    same `--rdzv-id` stops with `RendezvousPrefixHeldError` rather than join a stranger's job.
    """
    from ftrun.store.etcd_store import EtcdAuthError, EtcdStore  # etcd3gw

    members = [parse_rendezvous_endpoint(m, default_port=2379) for m in endpoint.split(",")]
    launch = f"{run_id}/{environ.get('SLURM_RESTART_COUNT') or 0}"
    health, store_lease = shared
    store = EtcdStore(
        members, launch, timeout, first_member=spread_start(len(members)), health=health
    )
    owner = environ.get("SLURM_JOB_ID")
    try:
        store.lease = store_lease or _launch_lease(store, lease_ttl_s)
        # Claims the prefix under Slurm; elsewhere only checks that etcd answers now.
        held = store.compare_set(OWNER_KEY, "", owner) if owner else store.check([OWNER_KEY])
    except EtcdAuthError as exc:
        raise RendezvousAuthError(str(exc)) from None
    except STORE_ERRORS as exc:
        raise RendezvousFailedError(f"cannot reach etcd at {endpoint}: {_one_line(exc)}") from None
    if owner and isinstance(held, bytes) and held != owner.encode():
        raise RendezvousPrefixHeldError(
            f"etcd prefix /ftrun/{launch}/ is held by Slurm job {held.decode(errors='replace')}, "
            f"not this one ({owner}): give this job another --rdzv-id"
        )
    log.info("the rendezvous store is etcd at %s (keys under /ftrun/%s/)", endpoint, launch)
    return store


def _launch_lease(store: EtcdStore, ttl_s: float | None) -> JobLease:
    """The launch's lease: the one its first launcher granted, or one granted now (a launcher
    that loses the race to write it revokes its own)."""
    ttl_s = ttl_s or JOB_LEASE_TTL_S
    [held] = store.read_now([LEASE_KEY])
    if held is None:
        granted = store.grant_lease(ttl_s)
        store.lease = JobLease(granted, ttl_s)  # the key that names it goes with it
        held = store.compare_set(LEASE_KEY, "", str(granted))
        if int(held) != granted:
            store.revoke_lease(granted)
    return JobLease(int(held), ttl_s)


def _open_store(host: str, port: int, serve: bool, timeout: datetime.timedelta) -> TCPStore:
    """Build the TCPStore in a helper thread and give up after `timeout` (plus a little).

    A client whose peer accepts the connection but never answers (a foreign program holding the
    port) blocks in TCPStore's handshake forever, whatever its timeout says. The constructor
    releases the GIL, so an abandoned daemon thread costs nothing but its stack.
    """
    call = Aside(
        lambda: TCPStore(host, port, is_master=serve, multi_tenant=True, timeout=timeout,
                         wait_for_workers=False, use_libuv=True),
        "ftrun-store-connect",
    )  # fmt: skip
    if not call.done(timeout.total_seconds() + _HANDSHAKE_SLACK_S):
        raise TimeoutError(f"no answer from a store there within {timeout.total_seconds():g}s")
    return call.result()


def _one_line(error: Exception | None) -> str:
    return str(error).strip().splitlines()[0] if error and str(error).strip() else repr(error)
