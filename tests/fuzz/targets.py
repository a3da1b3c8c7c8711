"""The boundaries fuzzed: each a decoder of bytes that another process, file or user controls,
valid seeds for it, and the errors it may raise (anything else, or a hang, is a failure).

A target's inputs are its seeds, corrupted (`corrupt`): truncated, a byte flipped, bytes
inserted or dropped, a length prefix made huge, replaced by random bytes, repeated (a replay in
the same buffer), JSON of the wrong shape, or nested past the parser's depth. The property: the
decoder returns a value or raises one of its typed errors, which its caller turns into one log
line or a one-line error.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import tempfile
from collections.abc import Callable

from hypothesis import strategies as st

from ftrun.agent.loop.flight_recorder import _parse as parse_collectives
from ftrun.agent.prewarm import wire
from ftrun.checkpointing import global_files, layout
from ftrun.checkpointing.global_files import FileEntry, Manifest
from ftrun.checkpointing.keeper import messages
from ftrun.checkpointing.keeper.errors import RestoreError
from ftrun.checkpointing.keeper.holdings import Choice, Decision, Outcome
from ftrun.errors import ConfigError, FtrunError, ProtocolError
from ftrun.eventlog.reader import parse_line
from ftrun.ft_launcher.build import build_config
from ftrun.ft_launcher.yaml_file import load_ft_yaml
from ftrun.inprocess_protocol import Interruption, Report, ReportKind
from ftrun.peer import protocol as peer
from ftrun.rank_monitor import protocol as monitor
from ftrun.rank_monitor.timings import SectionTimes
from ftrun.rendezvous.published import Progress, PublishedRound, reported_iteration
from ftrun.straggler.assemble import decode_node


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    decode: Callable[[bytes], object]
    seeds: tuple[bytes, ...]
    allowed: tuple[type[BaseException], ...]
    """The errors the decoder documents; its callers catch exactly these."""
    slow_s: float = 1.0
    """A decode taking more CPU seconds than this on one input counts as a hang (inputs are at
    most ~100 KB; PyYAML, pure Python, reads that much in about a second)."""


def _frames() -> tuple[bytes, ...]:
    return tuple(
        monitor.encode(m)
        for m in (
            monitor.Hello(seq=1, rank=3, pid=4242, warmup_iterations=2),
            monitor.Heartbeat(iteration=7),
            monitor.Heartbeat(),
            monitor.SectionStart("step"),
            monitor.SectionEnd("step", iteration=8),
            monitor.EndAllSections(),
        )
    )


def _wire_seeds() -> tuple[bytes, ...]:
    spawn = {
        "v": wire.PROTOCOL_VERSION,
        "op": "spawn",
        "id": 1,
        "module": False,
        "target": "train.py",
        "args": ["--lr", "1"],
        "env": {"RANK": "0"},
        "cwd": "/tmp",
        "gate": True,
        "cuda_device": None,
    }
    ready = {
        "v": wire.PROTOCOL_VERSION,
        "op": "ready",
        "imported": ["torch"],
        "failed": [],
        "unforkable": None,
    }
    return tuple(json.dumps(m).encode() for m in (spawn, ready))


def _part_header() -> bytes:
    metadata = {
        "ftckpt.version": "1",
        "ftckpt.iteration": "5",
        "ftckpt.skeleton": json.dumps({"$dict": {"w": {"$tensor": 0}}}),
        "ftckpt.crc32c": "0badf00d",
    }
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    return json.dumps({"__metadata__": metadata, "0": entry}).encode()


def _published() -> tuple[bytes, ...]:
    rows = (("n0", 0, 2), ("n1", 1, 2))
    return (
        PublishedRound(rows=rows, indices=(0, 1)).encode(),
        PublishedRound(rows=rows, indices=(1,), standby=(0,), progress=Progress(7, 1)).encode(),
    )


def _keeper_seeds() -> tuple[bytes, ...]:
    holdings = {"v": 1, "node": "n0", "sessions": {"s": [[5, 0, 2, 1024]]}}
    return (json.dumps(holdings).encode(),)


def _keeper_replies() -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    decision = Decision(2, True, {"s": Choice(40, 4, "from node 1")}, (0, 1), frozenset({3}))
    outcome = Outcome({"s": frozenset({2})}, None)
    return (messages.encode_decision(decision).encode(),), (
        messages.encode_outcome(outcome).encode(),
    )


def _manifest() -> bytes:
    files = {"__0_0.distcp": FileEntry(1024, 0xBADF00D), ".metadata": FileEntry(77, 0x1234)}
    return global_files.encode_manifest(Manifest(30, 4, files))


def _more_frames() -> tuple[bytes, ...]:
    cause = Interruption(1, "EXCEPTION", "ValueError: x", 1.0)
    recovered = Report(ReportKind.RECOVERED, 2, iteration=3, cause=cause, seconds=0.4)
    step = SectionTimes("step", False, (1_000_000, 2_000_000))
    return (
        monitor.encode(monitor.Goodbye()),
        monitor.encode(monitor.Reply(seq=3, ok=False, error="no such section")),
        monitor.encode(monitor.InprocessNote(rank=1, pid=4243, report=recovered)),
        monitor.encode(monitor.Timings(rank=0, pid=4242, sections=(step,))),
    )


def _event_lines() -> tuple[bytes, ...]:
    event = {"event": "restart", "ts": 1.5, "mono": 2.5, "node": "n0", "cycle": 1, "rank": 0}
    return (json.dumps(event).encode(),)


def _straggler_node() -> bytes:
    body = {"seq": 1, "ranks": [0, 1], "cpu": {}, "gpu": {}}
    return json.dumps(body).encode()


def _argv(raw: bytes) -> object:
    """A command line from bytes: NUL-separated tokens, as a shell would hand them over."""
    argv = [t for t in raw.decode("utf-8", "replace").split("\0") if t]
    return build_config(argv, {}, devices=lambda: 1)


_ARGV_SEEDS = tuple(
    "\0".join(argv).encode()
    for argv in (
        ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", "train.py", "--lr", "1"],
        ["--standalone", "--ft-rank-heartbeat-timeout=30", "--ft-restart-policy=any-failed", "x"],
        ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29500", "--ft-cfg-path", "", "x"],
    )
)


def _yaml(raw: bytes) -> object:
    with tempfile.NamedTemporaryFile(suffix=".yaml") as file:
        file.write(raw)
        file.flush()
        return load_ft_yaml(file.name)


_YAML_SEEDS = (
    b"fault_tolerance:\n  rank_heartbeat_timeout: 30\n  max_restarts: 3\n",
    b"model:\n  fault_tolerance:\n    initial_rank_heartbeat_timeout: 60\n"
    b"    rank_section_timeouts:\n      step: 10\n",
)


def _collectives(raw: bytes) -> object:
    return parse_collectives(raw.decode("utf-8", "replace"))


_COLLECTIVES = (b'[{"rank": 0, "entries": [{"seq": 4, "op": "allreduce", "state": "completed"}]}]',)


TARGETS: tuple[Target, ...] = (
    Target("rank monitor frame", monitor.decode, _frames() + _more_frames(), (ProtocolError,)),
    Target(
        "fork server, to the server",
        lambda raw: wire.decode(raw, wire.TO_SERVER),
        _wire_seeds(),
        (wire.ProtocolViolation,),
    ),
    Target(
        "fork server, to the agent",
        lambda raw: wire.decode(raw, wire.TO_AGENT),
        _wire_seeds(),
        (wire.ProtocolViolation,),
    ),
    Target(
        "peer channel header",
        peer.parse_header,
        (peer.encode_header("part", 16, {"key": "5/0/2"})[peer.PREFIX.size :],),
        (peer.PeerProtocolError,),
    ),
    Target(
        "checkpoint part header",
        lambda raw: layout.decode_header(raw, 16),
        (_part_header(),),
        (ValueError,),
    ),
    Target("keeper holdings", messages.decode_holdings, _keeper_seeds(), (RestoreError,)),
    Target(
        "global checkpoint sidecar",
        global_files.decode_entries,
        (b'{"model.pt": [16, "0badf00d"]}',),
        (ValueError,),
    ),
    Target(
        "events log line",
        lambda raw: parse_line(raw.decode("utf-8", "replace")),
        _event_lines(),
        (),
    ),
    Target("published rendezvous round", PublishedRound.decode, _published(), (FtrunError,)),
    Target("straggler node record", decode_node, (_straggler_node(),), (ValueError,)),
    Target("keeper decision", messages.decode_decision, _keeper_replies()[0], (RestoreError,)),
    Target("keeper outcome", messages.decode_outcome, _keeper_replies()[1], (RestoreError,)),
    Target(
        "global checkpoint manifest", global_files.decode_manifest, (_manifest(),), (ValueError,)
    ),
    Target("launcher command line", _argv, _ARGV_SEEDS, (ConfigError,)),
    Target("--ft-cfg-path YAML", _yaml, _YAML_SEEDS, (ConfigError,), slow_s=10.0),
    Target("a rank's progress report (store)", reported_iteration, (b"12", b"0"), ()),
    Target("flight recorder dump", _collectives, _COLLECTIVES, ()),
    Target(
        "in-process interruption record",
        Interruption.decode,
        (Interruption(1, "EXCEPTION", "ValueError: x", 1.0).encode(),),
        (),
    ),
)


HOW = ("keep", "truncate", "flip", "insert", "drop", "huge", "random", "replay", "json", "deep")


@st.composite
def corrupt(draw: st.DrawFn, seeds: tuple[bytes, ...]) -> bytes:
    """A seed, corrupted one way (or kept whole: valid input must pass too)."""
    data = bytearray(draw(st.sampled_from(seeds)))
    how = draw(st.sampled_from(HOW))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if how == "truncate":
        del data[at:]
    elif how == "flip" and data:
        data[at] ^= draw(st.integers(1, 255))
    elif how == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=64))
    elif how == "drop" and data:
        del data[at : at + draw(st.integers(1, 16))]
    elif how == "huge":
        data[at:at] = struct.pack("!I", draw(st.sampled_from([2**31 - 1, 2**32 - 1, 0])))
    elif how == "random":
        data = bytearray(draw(st.binary(max_size=512)))
    elif how == "replay":
        data = data + data
    elif how == "deep":  # nesting past the parser's recursion limit
        data[at:at] = b"[" * draw(st.sampled_from([1000, 100_000]))
    elif how == "json":  # a valid JSON document of the wrong shape
        data = bytearray(json.dumps(draw(_json)).encode())
    return bytes(data)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
