"""A live server under 10,000 random and mutated messages keeps serving its healthy rank."""

from __future__ import annotations

import queue
import random
import subprocess
from pathlib import Path

import msgpack
import zmq

from ftrun.rank_monitor import FirstProgress, RankMonitorConfig, RankMonitorServer
from ftrun.rank_monitor import protocol as wire
from support import python_cmd, wait_for

MESSAGES = 10_000
VALID = [
    wire.encode(m)
    for m in (
        wire.Hello(1, 1, 1),
        wire.Heartbeat(),
        wire.Heartbeat(2**40),  # version 2: with an iteration
        wire.SectionStart("step"),
        wire.SectionEnd("step"),
        wire.SectionEnd("step", 7),
        wire.EndAllSections(),
        wire.CalcTimeouts(2, True, None, True, True),
        wire.SetTimeouts(3, wire.Timeouts(1.0, 1.0, {"x": 1.0}, None)),
        wire.Goodbye(),
        wire.Reply(4, True, "", None),
    )
]


def mutated(rng: random.Random) -> list[bytes]:
    choice = rng.random()
    if choice < 0.25:
        return [rng.randbytes(rng.randrange(0, 200))]
    if choice < 0.35:
        junk = [1, "hb", None, -1, 2**63, 1.5, "x" * 300, {"a": [1, 2]}, [], b"\x00"]
        return [msgpack.packb([rng.choice(junk) for _ in range(rng.randrange(0, 7))])]
    if choice < 0.40:
        return [rng.choice(VALID) for _ in range(rng.randrange(2, 4))]  # extra frames
    if choice < 0.41:
        return [b"\x92" + b"x" * (wire.MAX_MESSAGE_BYTES + 10)]  # oversized
    frame = bytearray(rng.choice(VALID))
    for _ in range(rng.randrange(1, 4)):
        op, pos = rng.random(), rng.randrange(0, len(frame) + 1)
        if op < 0.4 and frame:
            frame[min(pos, len(frame) - 1)] = rng.randrange(256)
        elif op < 0.7:
            frame.insert(pos, rng.randrange(256))
        else:
            del frame[pos:]
    return [bytes(frame)]


def test_fuzzed_server_never_misjudges_a_healthy_rank(tmp_path: Path):
    config = RankMonitorConfig(
        initial_rank_heartbeat_timeout=2.0,
        rank_heartbeat_timeout=0.5,
        rank_section_timeouts={"step": 0.5},
        rank_out_of_section_timeout=0.5,
    )
    rng = random.Random(1234)
    notes: list[FirstProgress] = []
    with RankMonitorServer(config, job_dir=tmp_path / "job", on_progress=notes.append) as server:
        env = {**server.worker_env(), "RANK": "0"}
        # The fuzzing peer registers as rank 1 on behalf of a bystander process, so a verdict
        # against rank 1 (legitimate: it sends nonsense) signals that bystander, not pytest.
        with (
            subprocess.Popen(["sleep", "60"]) as bystander,
            subprocess.Popen(
                python_cmd("monitor_worker.py", "healthy", "4"),
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            ) as healthy,
        ):
            server.expect_rank(0, healthy.pid)
            server.expect_rank(1, bystander.pid)
            ctx = zmq.Context.instance()
            fuzzer = ctx.socket(zmq.DEALER)
            fuzzer.setsockopt(zmq.LINGER, 0)
            fuzzer.setsockopt(zmq.RECONNECT_IVL, 1)  # oversized frames cost a reconnect
            fuzzer.connect(server.address)
            fuzzer.send(wire.encode(wire.Hello(1, 1, bystander.pid)))
            try:
                for _ in range(MESSAGES):
                    fuzzer.send_multipart(mutated(rng))
                out, _ = healthy.communicate(timeout=60)
            finally:
                fuzzer.close()
                bystander.kill()
        assert healthy.returncode == 0
        assert out.strip() == "done"
        wait_for(lambda: server.dropped_messages > MESSAGES // 2, 10, "the fuzz to be processed")
        verdicts = []
        while True:
            try:
                verdicts.append(server.verdicts.get_nowait())
            except queue.Empty:
                break
        assert all(v.rank == 1 for v in verdicts), [v.describe() for v in verdicts]
        # progress notes: one per registration, the healthy rank's without an iteration
        assert [n.iteration for n in notes if n.rank == 0] == [None]
        assert {n.rank for n in notes} <= {0, 1}
