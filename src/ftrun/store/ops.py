"""Operations on any of the job's stores (TCPStore, `ftrun store`'s, etcd) beyond torch's
`Store` interface: waits bounded by a timeout that say whether the keys came, and the reads and
counts that a store able to do them in one request (`EtcdStore`: `get_within`, `read_now`,
`add_then_wait_on`) does so, the others in the plain calls."""

from __future__ import annotations

import datetime

from torch.distributed import Store


def wait_for_key(store: Store, key: str, timeout: float) -> bool:
    """Block until `key` exists or `timeout` passes; True if it exists."""
    return wait_for_keys(store, [key], timeout)


def wait_for_keys(store: Store, keys: list[str], timeout: float) -> bool:
    """Block until every one of `keys` exists or `timeout` passes; True if they all exist."""
    if not keys:
        return True
    if timeout <= 0:
        return store.check(keys)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as error:
        if "timeout" in str(error).lower():  # TCPStore's and EtcdStore's: no request more
            return False
        # A lost store, or another store error: `check` tells them apart by raising.
        return store.check(keys)
    return True


def get_if_exists(store: Store, key: str) -> bytes | None:
    """`key`'s value, or None when it does not exist (never waits: `get` would)."""
    return store.get(key) if store.check([key]) else None


def get_within(store: Store, key: str, timeout: float) -> bytes | None:
    """`key`'s value once it exists, or None after `timeout`. A store that hands the value over
    as it waits (`EtcdStore.get_within`: its watch carries it) does so in one request; any
    other waits, then reads."""
    native = getattr(store, "get_within", None)
    if native is not None:
        return native(key, timeout)
    return store.get(key) if wait_for_key(store, key, timeout) else None


def waits_are_requests(store: Store) -> bool:
    """Whether each wait on this store is a request of its own to it (`EtcdStore`: a watch), so
    that a waiter that wakes up every second loads it; TCPStore's server answers a wait from
    memory, and a 1 s chunk costs it nothing."""
    return getattr(store, "get_within", None) is not None


def read_now(store: Store, keys: list[str]) -> list[bytes | None] | None:
    """The keys' values now (None: absent) in one request, on a store that reads so
    (`EtcdStore.read_now`); None on any other (TCPStore's `multi_get` waits for absent keys)."""
    native = getattr(store, "read_now", None)
    return native(keys) if native is not None else None


def add_then_wait_on(store: Store, key: str, watched: str) -> int:
    """`store.add(key, 1)`; a store that can (`EtcdStore.add_then_wait_on`) looks at `watched`
    in the same request, so that the wait on it that follows starts with no read."""
    native = getattr(store, "add_then_wait_on", None)
    return native(key, watched) if native is not None else store.add(key, 1)


def existing_keys(store: Store, keys: list[str]) -> list[str]:
    """Those of `keys` that exist, in order, without waiting.

    The store answers only "all of them exist or not", so halve the groups that miss a key: a
    few missing keys among n cost O(missing * log n) checks, not n.
    """
    if not keys or store.check(keys):
        return keys
    if len(keys) == 1:
        return []
    half = len(keys) // 2
    return existing_keys(store, keys[:half]) + existing_keys(store, keys[half:])
