"""The fork server's wire protocol, shared by the server (`forkserver.py`) and the agent
(`client.py`).

Wire format, both directions: a 4-byte big-endian length, then that many bytes of a JSON object
with "v" (PROTOCOL_VERSION) and "op"; no pickle. Agent -> server: "spawn" (with the child's
stdout/stderr write ends, and optionally a start gate's read end, as SCM_RIGHTS on the same
sendmsg), and "deepen" (import more modules now, between cycles). Server -> agent: "hello",
"ready", "spawned", "error", "exit", "deepened". Agent -> a prestarted child, on its start
gate (a pipe): "preload" (modules to import while it waits), then "go", with the environment
it runs with (`read_gate`). `decode` validates every field on all sides. A frame longer than
MAX_FRAME breaks the framing: the server then stops; a well-framed but invalid message gets an
"error" reply and the server carries on.

Standard library only: the server imports it before anything else.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ftrun import untrusted_json

PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 20
"""Bytes; a spawn request is mostly its environment, far below this."""
MAX_FDS = 3
"""stdout and stderr write ends, and the optional start gate's read end."""
HEADER = struct.Struct("!I")


class ProtocolViolation(ValueError):
    """A frame or message that does not follow the protocol."""


# ---- protocol (shared with client.py) -------------------------------------------------------

_STR_LIST = "list[str]"
_STR_MAP = "dict[str,str]"
_OPT_INT = "int|None"
_OPT_STR = "str|None"

TO_SERVER: dict[str, dict[str, object]] = {
    "spawn": {"id": int, "module": bool, "target": str, "args": _STR_LIST, "env": _STR_MAP,
              "cwd": str, "gate": bool, "cuda_device": _OPT_INT},
    "deepen": {"modules": _STR_LIST},
}  # fmt: skip
_IMPORTS = {"imported": _STR_LIST, "failed": _STR_LIST, "unforkable": _OPT_STR}
TO_AGENT: dict[str, dict[str, object]] = {
    "hello": {"pid": int},
    "ready": _IMPORTS,
    "spawned": {"id": int, "pid": int},
    "error": {"id": _OPT_INT, "error": str},
    "exit": {"pid": int, "code": int},
    "deepened": _IMPORTS,
}
TO_CHILD: dict[str, dict[str, object]] = {
    "preload": {"modules": _STR_LIST},
    "go": {"env": _STR_MAP},
}
"""What a prestarted child reads on its start gate (`spawn` with `cuda_device`)."""


def encode(op: str, **fields: Any) -> bytes:
    """One frame: length header and the JSON message."""
    payload = json.dumps({"v": PROTOCOL_VERSION, "op": op, **fields}).encode()
    if len(payload) > MAX_FRAME:
        raise ProtocolViolation(f"{op} message of {len(payload)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes, schema: Mapping[str, Mapping[str, object]]) -> dict[str, Any]:
    """The message in one frame's payload, checked against `schema` (TO_SERVER or TO_AGENT)."""
    try:
        msg = untrusted_json.loads(payload)
    except ValueError as exc:  # UnicodeDecodeError is one
        raise ProtocolViolation(f"not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolViolation(f"not a JSON object: {type(msg).__name__}")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolViolation(f"protocol version {msg.get('v')!r}, expected {PROTOCOL_VERSION}")
    op = msg.get("op")
    fields = schema.get(op) if isinstance(op, str) else None
    if fields is None:
        raise ProtocolViolation(f"unknown op {op!r}")
    extra = set(msg) - set(fields) - {"v", "op"}
    if extra:
        raise ProtocolViolation(f"{op}: unexpected field(s) {sorted(extra)}")
    for name, kind in fields.items():
        if name not in msg:
            raise ProtocolViolation(f"{op}: missing field {name!r}")
        if not _conforms(msg[name], kind):
            shown = kind.__name__ if isinstance(kind, type) else kind
            raise ProtocolViolation(f"{op}: field {name!r} is not {shown}")
    return msg


def _conforms(value: object, kind: object) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is bool or kind is str:
        return isinstance(value, kind)  # type: ignore[arg-type]
    if kind == _OPT_INT:
        return value is None or _conforms(value, int)
    if kind == _OPT_STR:
        return value is None or isinstance(value, str)
    if kind == _STR_LIST:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == _STR_MAP:
        return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    raise AssertionError(kind)


def recv_frame(sock: socket.socket, max_fds: int = 0) -> tuple[bytes, list[int]] | None:
    """The next frame's payload and the fds that came with it; None on EOF before a frame.

    Reads exactly one frame (never into the next one's bytes, to which the kernel attaches that
    frame's fds). Received fds are closed again when the frame is broken.
    """
    fds: list[int] = []
    try:
        header = _recv_exact(sock, HEADER.size, fds, max_fds, eof_ok=True)
        if header is None:
            return None
        payload = _recv_exact(sock, _frame_size(header), fds, max_fds, eof_ok=False)
        assert payload is not None
    except BaseException:
        close_fds(*fds)
        raise
    return payload, fds


def _frame_size(header: bytes) -> int:
    """The payload size a frame's header gives; one over MAX_FRAME breaks the framing."""
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ProtocolViolation(f"frame of {size} bytes exceeds {MAX_FRAME}")
    return size


def _recv_exact(
    sock: socket.socket, size: int, fds: list[int], max_fds: int, eof_ok: bool
) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        if max_fds:
            chunk, got, flags, _ = socket.recv_fds(sock, size - len(data), max_fds)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolViolation(f"more than {max_fds} file descriptors in one frame")
        else:
            chunk = sock.recv(size - len(data))
        if not chunk:
            if eof_ok and not data:
                return None
            raise ProtocolViolation(f"EOF inside a frame ({len(data)} of {size} bytes)")
        data += chunk
    return bytes(data)


def read_gate(fd: int, preload: Callable[[list[str]], None]) -> dict[str, str] | None:
    """A prestarted child's "go" from its start gate: the environment to run with; None when
    the agent closed the gate without one (it withdrew the start, or died). "preload" frames
    before it (modules the script will import: `prestart.PRELOAD_ON_COMPILE`) go to `preload`.
    """
    while True:
        header = _read_exact(fd, HEADER.size)
        if header is None:
            return None
        payload = _read_exact(fd, _frame_size(header))
        if payload is None:
            return None
        msg = decode(payload, TO_CHILD)
        if msg["op"] == "go":
            return msg["env"]
        preload(msg["modules"])


def _read_exact(fd: int, size: int) -> bytes | None:
    """`size` bytes from a pipe (never into the next frame); None at EOF."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def send_frame(sock: socket.socket, frame: bytes, fds: Sequence[int] = ()) -> None:
    """Send one frame; `fds` travel with its first byte (SCM_RIGHTS)."""
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else 0
    if sent < len(frame):
        sock.sendall(frame[sent:])


def close_fds(*fds: int) -> None:
    """Close each of `fds`, ignoring those already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
