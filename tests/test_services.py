"""Node services: hooks in start order, closing in reverse, and nothing left open when a later
service fails to start or one fails to close."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest

from ftrun.rendezvous.ranks import NodeDescriptor, Round
from ftrun.services import NodeService, NodeServices

ROUND = Round(3, (NodeDescriptor("n0", "127.0.0.1", 2, 29500),), 0)


class Recording(NodeService):
    def __init__(self, name: str, journal: list[str], env: Mapping[str, str] = {}) -> None:
        self.name = name
        self._journal = journal
        self._env = dict(env)

    def worker_env(self, rnd: Round) -> Mapping[str, str]:
        return self._env

    def on_round(self, rnd: Round) -> None:
        self._journal.append(f"{self.name}.on_round({rnd.number})")

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self._journal.append(f"{self.name}.on_stopped({list(pids)})")

    def close(self) -> None:
        self._journal.append(f"{self.name}.close")


def test_hooks_run_in_start_order_and_close_in_reverse() -> None:
    journal: list[str] = []
    services = NodeServices()
    services.add(Recording("a", journal, {"A": "1", "SHARED": "a"}))
    services.add(Recording("b", journal, {"B": "2", "SHARED": "b"}))
    assert services.worker_env(ROUND) == {"A": "1", "B": "2", "SHARED": "b"}
    services.on_round(ROUND)
    services.on_stopped(ROUND, iter([11, 12]))
    services.close()
    assert journal == [
        "a.on_round(3)", "b.on_round(3)",
        "a.on_stopped([11, 12])", "b.on_stopped([11, 12])",
        "b.close", "a.close",
    ]  # fmt: skip


def test_a_service_failing_to_start_closes_those_started_before() -> None:
    journal: list[str] = []

    def start() -> None:
        services = NodeServices()
        try:
            services.add(Recording("monitor", journal))
            services.add(Recording("prewarm", journal))
            raise OSError("peer port taken")  # the next service's constructor fails
        finally:
            services.close()

    with pytest.raises(OSError, match="peer port taken"):
        start()
    assert journal == ["prewarm.close", "monitor.close"]


def test_one_failing_close_does_not_keep_the_others_open(caplog: pytest.LogCaptureFixture) -> None:
    journal: list[str] = []

    class Broken(Recording):
        def close(self) -> None:
            raise RuntimeError("boom")

    services = NodeServices()
    services.add(Recording("first", journal))
    services.add(Broken("broken", journal))
    services.add(Recording("last", journal))
    services.close()
    assert journal == ["last.close", "first.close"]
    assert "closing the broken service failed" in caplog.text


def test_kept_pids_are_the_union_of_the_services() -> None:
    class Keeps(NodeService):
        def __init__(self, pids: frozenset[int]) -> None:
            self._pids = pids

        def kept_pids(self) -> frozenset[int]:
            return self._pids

    services = NodeServices()
    services.add(Keeps(frozenset({10})))
    services.add(Keeps(frozenset({20, 21})))
    services.add(NodeService())
    assert services.kept_pids() == {10, 20, 21}
    services.close()
