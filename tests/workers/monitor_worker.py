"""A rank for rank-monitor tests: `monitor_worker.py MODE [STATE_FILE]`.

Prints "stuck" right before it stops making progress, so tests can line up with it.
"""

from __future__ import annotations

import json
import sys
import time

from ftrun.client_lib import RankMonitorClient


def never_sends_first_heartbeat(client: RankMonitorClient) -> None:
    print("stuck", flush=True)
    time.sleep(600)


def stops_heartbeating(client: RankMonitorClient) -> None:
    for _ in range(5):
        client.send_heartbeat()
        time.sleep(0.02)
    print("stuck", flush=True)
    time.sleep(600)


def stuck_in_section(client: RankMonitorClient) -> None:
    client.start_section("step")
    print("stuck", flush=True)
    time.sleep(600)


def too_long_out_of_section(client: RankMonitorClient) -> None:
    client.start_section("step")
    client.end_section("step")
    print("stuck", flush=True)
    time.sleep(600)


def healthy(client: RankMonitorClient) -> None:
    deadline = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:
        client.start_section("step")
        client.send_heartbeat()
        time.sleep(0.005)
        client.end_section("step")
    print("done", flush=True)


def progress(client: RankMonitorClient) -> None:
    """STEPS steps, each reporting its iteration (as end_section and heartbeat arguments)."""
    for step in range(1, int(sys.argv[2]) + 1):
        client.start_section("step")
        time.sleep(0.01)
        client.end_section("step", iteration=step)
        client.send_heartbeat(iteration=step)
    print("done", flush=True)


def calculate(client: RankMonitorClient) -> None:
    """Observe some intervals, calculate timeouts, save the state to STATE_FILE."""
    for _ in range(4):
        client.send_heartbeat()
        client.start_section("step")
        time.sleep(0.03)
        client.end_section("step")
        time.sleep(0.03)
    client.calculate_and_set_hb_timeouts()
    client.calculate_and_set_section_timeouts()
    with open(sys.argv[2], "w") as f:
        json.dump(client.state_dict(), f)
    print("done", flush=True)


def restore(client: RankMonitorClient) -> None:
    """Load STATE_FILE (after init) and print the state the client now holds."""
    with open(sys.argv[2]) as f:
        client.load_state_dict(json.load(f))
    print(json.dumps(client.state_dict()), flush=True)


MODES = {
    f.__name__: f
    for f in (
        never_sends_first_heartbeat,
        stops_heartbeating,
        stuck_in_section,
        too_long_out_of_section,
        healthy,
        progress,
        calculate,
        restore,
    )
}

if __name__ == "__main__":
    client = RankMonitorClient()
    client.init_workload_monitoring()
    MODES[sys.argv[1]](client)
    client.shutdown_workload_monitoring()
