"""The cycle info file the workers read: what it holds, and that it is replaced whole."""

from __future__ import annotations

import json
from pathlib import Path

from ftrun.agent.node_services.cycle_info import CycleInfoService
from ftrun.environment import Env
from ftrun.rendezvous.ranks import NodeDescriptor, Round

NODES = (NodeDescriptor("n0", "127.0.0.1", 2, 1), NodeDescriptor("n1", "127.0.0.1", 2, 2))


def test_each_round_replaces_the_file_workers_are_pointed_at(tmp_path: Path) -> None:
    causes = {0: "rank 1 on n0 exited with code 1"}
    service = CycleInfoService(tmp_path, "job-7", {"SLURM_RESTART_COUNT": "2"}, causes.get)
    first = Round(0, NODES, 1)
    assert service.worker_env(first) == {Env.CYCLE_INFO: str(tmp_path / "cycle-info.json")}

    service.on_round(first)
    assert json.loads(service.path.read_text()) == {
        "job_id": "job-7",
        "attempt": 2,
        "cycle": 0,
        "nodes": ["n0", "n1"],
        "group_rank": 1,
        "world_size": 4,
        "ranks": [2, 3],
        "last_cycle_ended": None,
    }
    service.on_round(Round(1, NODES, 0))
    info = json.loads(service.path.read_text())
    assert (info["cycle"], info["ranks"]) == (1, [0, 1])
    assert info["last_cycle_ended"] == "rank 1 on n0 exited with code 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cycle-info.json"]  # nothing aside


def test_attempt_defaults_to_zero_outside_slurm(tmp_path: Path) -> None:
    for environ in ({}, {"SLURM_RESTART_COUNT": "x"}):
        service = CycleInfoService(tmp_path, "job", environ, lambda _cycle: None)
        service.on_round(Round(0, NODES, 0))
        assert json.loads(service.path.read_text())["attempt"] == 0


def test_fields_the_services_describe_are_written_from_the_next_round_on(tmp_path: Path) -> None:
    described: dict[str, object] = {}
    service = CycleInfoService(tmp_path, "job", {}, lambda _cycle: None, described)
    service.on_round(Round(0, NODES, 0))
    assert "metrics" not in json.loads(service.path.read_text())
    described["metrics"] = "http://127.0.0.1:9400/metrics"
    described["status"] = None  # a service took its field back (the page moved)
    service.on_round(Round(1, NODES, 0))
    info = json.loads(service.path.read_text())
    assert info["metrics"] == "http://127.0.0.1:9400/metrics" and "status" not in info
