"""Fire-and-forget frames from a rank to its node's monitor: a DEALER socket of its own, sent
without blocking. A frame the socket's queue cannot take is dropped and counted: the training
step never waits. The straggler detector's timings and the in-process reports both go this way;
each names its rank and pid in the frame, so neither needs a HELLO. Light: no torch, no psutil."""

from __future__ import annotations

import zmq

from ftrun.rank_monitor.protocol import Message, encode


class MonitorSender:
    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        """`context`: the caller's own (it terms it at close, which flushes the last frames);
        None: the process-wide one."""
        self.dropped = 0
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)  # a last frame at shutdown gets half a second
        self._sock.setsockopt(zmq.SNDHWM, 1000)
        self._sock.connect(address)

    def send(self, message: Message) -> None:
        try:
            self._sock.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._sock.close()
