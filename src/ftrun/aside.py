"""A call run aside, on a thread of its own, for a caller that must not block with it: a hung
network filesystem, a peer that never answers, torch's rendezvous until its deadline, a
checkpoint's background write. The caller waits in steps of its choosing and may give up (a
daemon call runs on, abandoned; one that is not a daemon still completes before exit)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Aside(Generic[T]):
    """`fn()` started on a thread named `name` (a daemon unless told otherwise); `done` waits,
    `result` hands it over."""

    def __init__(self, fn: Callable[[], T], name: str, *, daemon: bool = True) -> None:
        self._outcome: list[tuple[bool, object]] = []  # (returned, its value or exception)

        def run() -> None:
            try:
                self._outcome.append((True, fn()))
            except BaseException as exc:  # handed to the caller's thread
                self._outcome.append((False, exc))

        self._thread = threading.Thread(target=run, name=name, daemon=daemon)
        self._thread.start()

    def done(self, timeout: float | None) -> bool:
        """Whether the call returned or raised, waiting at most `timeout` seconds for it (None:
        until it has)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> T:
        """The call's value, or its exception raised here; only once `done`."""
        returned, value = self._outcome[0]
        if not returned:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]
