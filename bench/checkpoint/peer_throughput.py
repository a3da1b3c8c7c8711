"""Peer channel throughput on loopback: 1 GiB `fetch_into` and `push`, against a memcpy.

The server runs in its own process (two agents are two processes); both ends hold the bytes in
pre-faulted anonymous shared memory (mmap), as the node-memory checkpoint tier will. Prints the
best and median of `--repeats` transfers in MB/s (10^6 bytes per second).

    python -m bench.checkpoint.peer_throughput [--gib 1] [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import zlib
from collections.abc import Callable

from bench.common import smoke
from bench.common.timing import seconds
from ftrun.peer import FileRegion, PeerClient, PeerServer, Reply, Request

SECRET = bytes(range(32))  # the spawned server imports this module again
JOB = "bench"
HOST = "127.0.0.1"


def filled(size: int) -> memoryview:
    """`size` bytes of anonymous memory, every page touched, with a non-trivial pattern."""
    import mmap

    view = memoryview(mmap.mmap(-1, size))
    block = os.urandom(1 << 20)
    for start in range(0, size, len(block)):
        view[start : start + len(block)] = block[: size - start]
    return view


def serve(size: int, ready: mp.Queue, stop: mp.Event) -> None:
    source = filled(size)
    sink = filled(size)
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.write(source)
        f.flush()

        def receive(request: Request) -> dict[str, int]:
            request.read_into(sink[: request.nbytes])
            return {"crc": zlib.crc32(sink[: request.nbytes]) if request.header["check"] else 0}

        server = PeerServer(HOST, SECRET, JOB)
        crc = zlib.crc32(source)
        server.register("get", lambda r: Reply({"crc": crc}, source))
        server.register("get_file", lambda r: Reply({}, FileRegion(f.fileno(), 0, size)))
        server.register("put", receive)
        with server:
            ready.put(server.port)
            stop.wait()


def measure(what: str, size: int, repeats: int, run: Callable[[], None]) -> float:
    rates = [size / seconds(run) / 1e6 for _ in range(repeats)]
    best, median = max(rates), statistics.median(rates)
    print(f"{what:<34} best {best:8.0f} MB/s   median {median:8.0f} MB/s")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = smoke.parse_args(parser, {"gib": 1 / 1024, "repeats": 1})
    size = int(args.gib * (1 << 30))
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(size, ready, stop))
    server.start()
    try:
        port = ready.get(timeout=120)
        local = filled(size)
        other = filled(size)
        client = PeerClient(SECRET, JOB)
        # Correctness once, outside the timing.
        header = client.fetch_into(HOST, port, "get", {}, local, timeout=120)
        assert header["crc"] == zlib.crc32(local), "fetch_into corrupted the bytes"
        assert (
            client.push(HOST, port, "put", {"check": True}, local, timeout=120)["crc"]
            == (header["crc"])
        ), "push corrupted the bytes"
        print(f"{size / (1 << 30):g} GiB, {args.repeats} repeats, {os.cpu_count()} CPUs")
        measure(
            "memcpy (one core)", size, args.repeats, lambda: other.__setitem__(slice(None), local)
        )
        measure(
            "fetch_into (sendall -> recv_into)",
            size,
            args.repeats,
            lambda: client.fetch_into(HOST, port, "get", {}, local, timeout=120),
        )
        measure(
            "fetch_into (sendfile /dev/shm)",
            size,
            args.repeats,
            lambda: client.fetch_into(HOST, port, "get_file", {}, local, timeout=120),
        )
        measure(
            "push (sendall -> recv_into)",
            size,
            args.repeats,
            lambda: client.push(HOST, port, "put", {"check": False}, local, timeout=120),
        )
        client.close()
    finally:
        stop.set()
        server.join(30)


if __name__ == "__main__":
    main()
