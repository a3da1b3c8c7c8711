"""A call run aside, on a daemon thread of its own, for a caller that must not block with it: a
hung network filesystem, a peer that never answers, torch's rendezvous until its deadline. The
caller waits in steps of its choosing and may give up (the call runs on, abandoned)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Aside(Generic[T]):
    """`fn()` started on a daemon thread named `name`; `done` waits, `result` hands it over."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self._outcome: list[tuple[bool, object]] = []  # (returned, its value or exception)

        def run() -> None:
            try:
                self._outcome.append((True, fn()))
            except BaseException as exc:  # handed to the caller's thread
                self._outcome.append((False, exc))

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def done(self, timeout: float) -> bool:
        """Whether the call returned or raised, waiting at most `timeout` seconds for it."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> T:
        """The call's value, or its exception raised here; only once `done`."""
        returned, value = self._outcome[0]
        if not returned:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]
