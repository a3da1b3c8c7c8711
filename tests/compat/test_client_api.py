"""NVRx 0.7's documented RankMonitorClient API, written from its docs and signatures: the
read-only timeout views, `is_initialized`, `init_workload_monitoring(num_warmup_iters=)`, and
its saved state (`{"current_timeouts": ...}`) loading into ftrun's client and back."""

from __future__ import annotations

import json
import os
import queue
from collections.abc import Callable

import pytest

from ftrun.client_lib import RankMonitorClient, RankMonitorClientError
from ftrun.client_lib.timeouts import HeartbeatTimeouts, from_state

# What NVRx 0.7's client saves after calculate_and_set_hb_timeouts() and
# calculate_and_set_section_timeouts(["step"], calc_out_of_section=True).
NVRX_STATE = {
    "current_timeouts": {
        "heartbeat": {"initial": 120.0, "subsequent": 7.5, "were_calculated": True},
        "section": {
            "section": {"step": 4.0, "checkpoint": 30.0},
            "out_of_section": 9.0,
            "calculated_sections": ["step"],
            "is_out_of_section_calculated": True,
        },
    }
}


def test_views_before_and_after_init(make_server: Callable, in_process_client: Callable) -> None:
    server = make_server(rank_section_timeouts={"step": 60.0}, rank_out_of_section_timeout=30.0)
    fresh = RankMonitorClient()
    assert (fresh.is_initialized, fresh.hb_timeouts, fresh.section_timeouts) == (False, None, None)
    client = in_process_client(server, 0)
    assert client.is_initialized
    assert client.hb_timeouts == HeartbeatTimeouts(60.0, 60.0, were_calculated=False)
    assert client.hb_timeouts.are_valid
    sections = client.section_timeouts
    assert (sections.section, sections.out_of_section) == ({"step": 60.0}, 30.0)
    assert (sections.calculated_sections, sections.is_out_of_section_calculated) == (set(), False)
    client.shutdown_workload_monitoring()
    assert not client.is_initialized


def test_nvrx_saved_state_loads_before_init(
    make_server: Callable, in_process_client: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job resumed from an NVRx-era checkpoint: the calculated timeouts apply, the rest
    (the `checkpoint` section, not calculated) stays as the launcher configured it."""
    server = make_server(rank_section_timeouts={"step": 60.0, "checkpoint": 60.0})
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(0, os.getpid())
    client = RankMonitorClient()
    client.load_state_dict(NVRX_STATE)
    client.init_workload_monitoring()
    try:
        assert client.hb_timeouts == HeartbeatTimeouts(120.0, 7.5, were_calculated=True)
        sections = client.section_timeouts
        # 4 s calculated is raised to the floor (--ft-workload-check-interval, 5 s as NVRx's)
        assert sections.section == {"step": 5.0, "checkpoint": 60.0}
        assert sections.out_of_section == 9.0
        assert sections.calculated_sections == {"step"}
        assert sections.is_out_of_section_calculated
        saved = json.loads(json.dumps(client.state_dict()))  # JSON-able, as NVRx's
        assert saved["current_timeouts"]["heartbeat"] == NVRX_STATE["current_timeouts"]["heartbeat"]
        assert saved["current_timeouts"]["section"]["calculated_sections"] == ["step"]
        assert from_state(saved)["heartbeat"] == from_state(NVRX_STATE)["heartbeat"]
    finally:
        client.shutdown_workload_monitoring()


def test_nothing_calculated_saves_nvrx_empty_state() -> None:
    assert RankMonitorClient().state_dict() == {"current_timeouts": {}}
    assert from_state({"current_timeouts": {}}) == {}


@pytest.mark.parametrize(
    "state",
    [
        {"current_timeouts": []},
        {"current_timeouts": {"heartbeat": {"initial": "x", "subsequent": 1.0}}},
        {"current_timeouts": {"section": {"section": {}, "calculated_sections": ["step"]}}},
        {"current_timeouts": {"heartbeat": {"initial": -1.0, "subsequent": 1.0}}},
        {"bogus": 1},
    ],
    ids=["not-a-map", "not-a-number", "missing-section", "negative", "unknown"],
)
def test_bad_saved_state_is_a_client_error(state: dict) -> None:
    with pytest.raises(RankMonitorClientError):
        RankMonitorClient().load_state_dict(state)


def test_num_warmup_iters_reaches_the_server(
    make_server: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVRx's `init_workload_monitoring(num_warmup_iters=)`: the rank's first N steps are
    judged with the `warmup` section timeout."""
    server = make_server(rank_section_timeouts={"step": 0.2, "warmup": 60.0})
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(0, os.getpid())
    client = RankMonitorClient()
    with pytest.raises(RankMonitorClientError, match="num_warmup_iters"):
        client.init_workload_monitoring(num_warmup_iters=-1)
    client.init_workload_monitoring(num_warmup_iters=1)
    try:
        client.start_section("step")
        with pytest.raises(queue.Empty):  # past the step timeout, inside the warm-up one
            server.verdicts.get(timeout=0.6)
        client.end_section("step")
        client.start_section("step")  # the second step: warm-up is over
        verdict = server.verdicts.get(timeout=10)
        assert verdict.section == "step"
    finally:
        client.shutdown_workload_monitoring()


def test_calculated_and_loaded_timeouts_have_a_floor_explicit_ones_do_not(
    make_server: Callable, in_process_client: Callable
) -> None:
    """NVRx's `train_ddp_sections_api.py` resumed with a calculated `checkpoint` timeout of
    0.021 s: NVRx, checking every 5 s, never judged it that fast. ftrun raises calculated and
    loaded timeouts to --ft-workload-check-interval; a timeout given to the launcher stays."""
    server = make_server(rank_section_timeouts={"step": 0.5, "checkpoint": 60.0},
                         calculated_timeout_floor=5.0)  # fmt: skip
    client = in_process_client(server, 0)
    client.load_state_dict({"sections": {"checkpoint": 0.021, "step": 0.5}})
    assert client.section_timeouts.section == {"step": 0.5, "checkpoint": 5.0}
    for _ in range(2):
        client.start_section("step")
        client.end_section("step")
    client.calculate_and_set_section_timeouts(["step"], calc_out_of_section=False)
    assert client.section_timeouts.section["step"] == 5.0  # 5 x a few microseconds, floored


@pytest.mark.parametrize("api", ["heartbeats", "sections"])
def test_a_resumed_run_loads_the_state_after_init_as_nvrx_s_examples_do(
    make_server: Callable, in_process_client: Callable, api: str
) -> None:
    """NVRx's train_ddp_*_api.py: run 1 calculates and saves `state_dict()` (JSON); run 2
    calls `init_workload_monitoring()` first, then `load_state_dict` with it."""
    server = make_server(rank_section_timeouts={"init": 20.0, "step": 10.0},
                         rank_out_of_section_timeout=30.0, safety_factor=1000.0)  # fmt: skip
    first = in_process_client(server, 0)
    for _ in range(3):
        if api == "sections":
            first.start_section("step")
            first.end_section("step")
        else:
            first.send_heartbeat()
    if api == "sections":
        first.calculate_and_set_section_timeouts(["step"], calc_out_of_section=True)
    else:
        first.calculate_and_set_hb_timeouts()
    calculated = (first.hb_timeouts, first.section_timeouts)
    saved = json.loads(json.dumps(first.state_dict()))
    first.shutdown_workload_monitoring()
    resumed = make_server(rank_section_timeouts={"init": 20.0, "step": 10.0},
                          rank_out_of_section_timeout=30.0)  # fmt: skip
    second = in_process_client(resumed, 0)
    second.load_state_dict(saved)
    if api == "sections":
        assert second.section_timeouts.calculated_sections == {"step"}
        assert second.section_timeouts.section["init"] == 20.0  # not calculated: configured
        assert second.section_timeouts == calculated[1]
    else:
        assert second.hb_timeouts.were_calculated and second.hb_timeouts.are_valid
        assert second.hb_timeouts == calculated[0]
