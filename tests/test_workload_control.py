"""Workload control requests: a worker asks its node's agent to continue, to exclude the node or
to shut the job down (NVRx's `send_workload_control_request`), through a real server."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

import ftrun.client_lib.client as client_module
from ftrun import rank_monitor
from ftrun.client_lib import (
    RankMonitorClient,
    RankMonitorClientError,
    WorkloadAction,
    WorkloadControlRequest,
)
from ftrun.errors import ProtocolError
from ftrun.rank_monitor import RankMonitorServer, WorkloadControl
from ftrun.rank_monitor import protocol as wire
from ftrun.rank_monitor.workload import MAX_DESCRIPTION_LEN
from support import wait_for

# A rank in a child of the process the owner spawned: it registers, waits for "go" on stdin
# (so the test can `expect_rank` first), sends one request, and exits right away.
CHILD = textwrap.dedent(
    """
    import os, sys
    from ftrun.client_lib import RankMonitorClient, WorkloadAction, WorkloadControlRequest
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    client = RankMonitorClient()
    client.init_workload_monitoring()
    client.send_workload_control_request(
        WorkloadControlRequest(WorkloadAction[sys.argv[1]], sys.argv[2])
    )
    """
)
SPAWNED = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', *sys.argv[1:]]))"


@pytest.fixture
def controls() -> queue.SimpleQueue[WorkloadControl]:
    return queue.SimpleQueue()


@pytest.fixture
def raw_peer() -> Iterator:
    """A bare DEALER socket on `server`: sends any frames, reads replies with a deadline."""
    socks: list[zmq.Socket] = []

    def open_peer(server: RankMonitorServer) -> tuple:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        socks.append(sock)

        def reply() -> wire.Reply:
            assert sock.poll(10_000), "no reply from the server within 10 s"
            answer = wire.decode(sock.recv())
            assert isinstance(answer, wire.Reply)
            return answer

        return sock, reply

    yield open_peer
    for sock in socks:
        sock.close()


# ---- the request, and its wire form ----------------------------------------------------------


def test_the_nvrx_names_and_values():
    assert [(a.name, a.value) for a in WorkloadAction] == [
        ("Continue", 0),
        ("ExcludeThisNode", 1),
        ("ShutdownWorkload", 2),
    ]
    assert all(a.__doc__ for a in WorkloadAction)  # each member says what it does
    assert rank_monitor.WorkloadAction is WorkloadAction
    assert rank_monitor.WorkloadControlRequest is WorkloadControlRequest


def test_the_request_is_validated_and_long_descriptions_are_truncated():
    request = WorkloadControlRequest(WorkloadAction.ExcludeThisNode, "bad GPU")
    assert (request.action, request.description) == (WorkloadAction.ExcludeThisNode, "bad GPU")
    assert WorkloadControlRequest(WorkloadAction.Continue).description == "<not set>"
    with pytest.raises(TypeError, match=r"action must be a WorkloadAction.*not int"):
        WorkloadControlRequest(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"action must be a WorkloadAction.*not str"):
        WorkloadControlRequest("ShutdownWorkload")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="description must be a str, not bytes"):
        WorkloadControlRequest(WorkloadAction.Continue, b"why")  # type: ignore[arg-type]
    exact = "x" * MAX_DESCRIPTION_LEN
    assert WorkloadControlRequest(WorkloadAction.Continue, exact).description == exact
    cut = WorkloadControlRequest(WorkloadAction.Continue, "y" * 5000).description
    assert len(cut) == MAX_DESCRIPTION_LEN == 1024 and cut.endswith("y...")
    with pytest.raises(AttributeError):
        request.description = "changed"  # type: ignore[misc]


@pytest.mark.parametrize("action", [0, 1, 2])
def test_the_control_message_round_trips(action):
    message = wire.Control(9, action, "why é")
    assert wire.decode(wire.encode(message)) == message


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ([1, 3, "x"], "workload action must be one of"),
        ([1, -1, "x"], "workload action"),
        ([1, True, "x"], "workload action"),
        ([1, 1.0, "x"], "workload action"),
        ([1, "ExcludeThisNode", "x"], "workload action"),
        ([1, None, "x"], "workload action"),
        ([1, 1, None], "description"),
        ([1, 1, b"bytes"], "description"),
        ([1, 1, "x" * (MAX_DESCRIPTION_LEN + 1)], "description"),
        ([-1, 1, "x"], "seq"),
        ([1, 1], "takes 3 fields"),
        ([1, 1, "x", 4], "takes 3 fields"),
    ],
)
def test_malformed_control_messages_are_refused(fields, error):
    with pytest.raises(ProtocolError, match=error):
        wire.decode(msgpack.packb([1, "ctl", *fields], use_bin_type=True))


# ---- through a real server -------------------------------------------------------------------


@pytest.mark.parametrize("action", list(WorkloadAction))
def test_each_action_reaches_the_owner_before_the_call_returns(
    make_server, in_process_client, controls, action
):
    server = make_server(on_control=controls.put)
    client = in_process_client(server, 3)
    before = time.monotonic()
    client.send_workload_control_request(WorkloadControlRequest(action, f"because {action.name}"))
    control = controls.get_nowait()  # acknowledged only once the owner had it
    me = os.getpid()
    assert control == WorkloadControl(3, me, me, action, f"because {action.name}", control.at)
    assert before <= control.at <= time.monotonic()
    said = f"rank 3 (pid {me}) requests {action.name}: 'because {action.name}'"
    assert control.describe() == said
    assert server.dropped_messages == 0


def test_a_worker_that_exits_right_after_sending_was_heard(make_server, controls):
    """A real rank in a child of the spawned process: the control names both pids, its long
    description arrives truncated, and it is on the owner's queue once the rank has exited."""
    server = make_server(on_control=controls.put)
    env = {**server.worker_env(), "RANK": "5", "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-c", SPAWNED, CHILD, "ExcludeThisNode", "bad GPU " + "z" * 3000]
    with subprocess.Popen(
        args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as spawned:
        try:
            assert spawned.stdin is not None and spawned.stdout is not None
            rank_pid = int(spawned.stdout.readline())
            server.expect_rank(5, spawned.pid)
            spawned.stdin.write("go\n")
            spawned.stdin.flush()
            assert spawned.wait(timeout=30) == 0
        finally:
            spawned.kill()
    control = controls.get_nowait()
    assert (control.rank, control.pid, control.worker_pid) == (5, rank_pid, spawned.pid)
    assert control.action is WorkloadAction.ExcludeThisNode
    assert control.description.startswith("bad GPU zzz") and control.description.endswith("z...")
    assert len(control.description) == MAX_DESCRIPTION_LEN


def test_unregistered_and_malformed_requests_are_dropped_and_counted(
    make_server, raw_peer, controls, in_process_client
):
    server = make_server(on_control=controls.put)
    stranger, stranger_reply = raw_peer(server)
    stranger.send(wire.encode(wire.Control(1, 2, "shut it all down")))
    answer = stranger_reply()
    assert (answer.seq, answer.ok) == (1, False) and "not registered" in answer.error
    assert server.dropped_messages == 1

    # A registered peer sending nonsense: dropped as well, and never handed to the owner.
    server.expect_rank(1, os.getpid())
    peer, peer_reply = raw_peer(server)
    peer.send(wire.encode(wire.Hello(1, 1, os.getpid())))
    assert peer_reply().ok
    bad = [[2, 7, "x"], [3, "1", "x"], [4, 1, 5], [5, 1, "x" * (MAX_DESCRIPTION_LEN + 1)], [6]]
    for fields in bad:
        peer.send(msgpack.packb([1, "ctl", *fields], use_bin_type=True))
    peer.send_multipart([wire.encode(wire.Control(7, 1, "x")), b"extra frame"])
    wait_for(lambda: server.dropped_messages == 1 + len(bad) + 1, 10, "the drops to be counted")
    with pytest.raises(queue.Empty):
        controls.get_nowait()

    # ... and the server keeps serving: the same peer's valid request, and a client's.
    peer.send(wire.encode(wire.Control(8, 0, "all good")))
    assert (peer_reply().seq, controls.get_nowait().description) == (8, "all good")
    in_process_client(server, 2).send_workload_control_request(
        WorkloadControlRequest(WorkloadAction.ShutdownWorkload, "fatal")
    )
    control = controls.get_nowait()
    assert (control.rank, control.action) == (2, WorkloadAction.ShutdownWorkload)
    assert server.dropped_messages == 1 + len(bad) + 1


def test_sending_before_init_or_a_wrong_type_raises():
    client = RankMonitorClient()
    request = WorkloadControlRequest(WorkloadAction.ShutdownWorkload, "x")
    with pytest.raises(
        RankMonitorClientError,
        match=r"^send_workload_control_request\(\) before init_workload_monitoring\(\)$",
    ):
        client.send_workload_control_request(request)
    with pytest.raises(RankMonitorClientError, match="expected a WorkloadControlRequest, not int"):
        client.send_workload_control_request(WorkloadAction.ShutdownWorkload.value)  # type: ignore[arg-type]


def test_a_request_nobody_takes_raises(make_server, in_process_client):
    """Without an `on_control` owner, or with one that fails, the rank learns it was not heard;
    the server goes on serving."""

    def broken(_control: WorkloadControl) -> None:
        raise RuntimeError("owner bug")

    for on_control, rank in ((None, 0), (broken, 1)):
        progress: list = []
        server = make_server(on_control=on_control, on_progress=progress.append)
        client = in_process_client(server, rank)
        request = WorkloadControlRequest(WorkloadAction.ExcludeThisNode)
        with pytest.raises(RankMonitorClientError, match="refused: the launcher did not take it"):
            client.send_workload_control_request(request)
        client.send_heartbeat()
        wait_for(lambda p=progress, r=rank: [n.rank for n in p] == [r], 5, "the server serving")


def test_no_reply_within_the_request_timeout_raises(make_server, in_process_client, monkeypatch):
    server = make_server(on_control=lambda _control: None)
    client = in_process_client(server, 0)
    server.stop()  # the monitor is gone
    monkeypatch.setattr(client_module, "REQUEST_TIMEOUT_S", 0.2)
    with pytest.raises(RankMonitorClientError, match=r"^no answer from the monitor within 0.2s$"):
        client.send_workload_control_request(WorkloadControlRequest(WorkloadAction.Continue))
