"""A light rank for the fault matrix: the monitor client and injected faults, no torch.

Every step (--steps; --first-cycle-steps in cycle 0): start_section("step"), sleep
--step-time, end_section("step"), send_heartbeat(), append "<cycle> <step> <time>" to
<ckpt-dir>/progress-rank<R>.txt (as examples/train_ddp.py does). After the last step the rank
writes <ckpt-dir>/done-rank<R> (holding the cycle) and exits 0. Ranks never talk to each other.

Faults take CYCLE:RANK:STEP (CYCLE may be `*`: every cycle) and fire once, at that step, inside
the "step" section unless said otherwise. A fault waits first for <ckpt-dir>/<--fault-after>
when that is given (so a fault can wait for another rank to be set up):

--exit C:R:S:CODE     exit with CODE            --signal C:R:S:NAME  kill itself with signal NAME
--segv C:R:S          a real segmentation fault --hang C:R:S         sleep inside the section
--raise C:R:S,...     raise a ValueError (a traceback; several specs: one per cycle or rank)
--raise-on-marked S   local rank 0 raises at step S of every cycle on a node that a test marked
                      (<ckpt-dir>/fail-<FTRUN_NODE> exists)
--hang-outside C:R:S  sleep after end_section, before the heartbeat (out of any section)
--hang-first-hb C:R   sleep after init_workload_monitoring(), before the first heartbeat
--stubborn C:R        ignore SIGTERM and start two children that ignore it too, one of them in
                      a session of its own; their pids and its own go to <ckpt-dir>/stubborn-pids
--flood               a thread sends heartbeats in a tight loop for the whole run
--garbage             a raw DEALER on $FTRUN_MONITOR_ADDR sends random and mutated frames
--out-of-fds C:R:S    open files until the descriptor limit (lowered first) refuses one: the
                      OSError (EMFILE) goes up as a user's script would let it
--out-of-memory C:R:S allocate past an address-space limit set just above what the rank uses:
                      the MemoryError goes up (no cgroup here for the kernel's OOM killer, whose
                      SIGKILL is the SIGKILL case)
--busy N              N children spin on the CPU for the whole run (in the rank's process group)
--start-after FILE    wait for <ckpt-dir>/FILE before connecting to the rank monitor (no timeout
                      runs meanwhile: a test sets up its observer first)

On SIGTERM (unless stubborn) the rank writes <ckpt-dir>/checkpoint-rank<R> (cycle and last
step) at the end of the current step and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ftrun.client_lib import RankMonitorClient

CYCLE = int(os.environ.get("FTRUN_CYCLE", "0"))
RANK = int(os.environ.get("RANK", "0"))
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
_stop_requested = False
STOP = threading.Event()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--first-cycle-steps", type=int, default=0, help="cycle 0 (0: --steps)")
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--fault-after", default="")
    parser.add_argument("--exit", default="", metavar="C:R:S:CODE")
    parser.add_argument("--signal", default="", metavar="C:R:S:NAME")
    parser.add_argument("--segv", default="", metavar="C:R:S")
    parser.add_argument("--hang", default="", metavar="C:R:S")
    parser.add_argument("--raise", dest="raise_", default="", metavar="C:R:S,...")
    parser.add_argument("--raise-on-marked", type=int, default=0, metavar="S")
    parser.add_argument("--hang-outside", default="", metavar="C:R:S")
    parser.add_argument("--hang-first-hb", default="", metavar="C:R")
    parser.add_argument("--stubborn", default="", metavar="C:R")
    parser.add_argument("--flood", action="store_true")
    parser.add_argument("--garbage", action="store_true")
    parser.add_argument("--out-of-fds", default="", metavar="C:R:S")
    parser.add_argument("--out-of-memory", default="", metavar="C:R:S")
    parser.add_argument("--busy", type=int, default=0, metavar="N")
    parser.add_argument("--start-after", default="", metavar="FILE")
    return parser.parse_args()


def matches(spec: str, step: int | None = None) -> str | None:
    """The spec's extra field ("" if none) when it names this cycle, rank (and step)."""
    if not spec:
        return None
    cycle, rank, *rest = spec.split(":")
    if (cycle != "*" and int(cycle) != CYCLE) or int(rank) != RANK:
        return None
    if step is not None:
        if int(rest[0]) != step:
            return None
        rest = rest[1:]
    return rest[0] if rest else ""


def await_file(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.01)


def hang_in_step() -> None:
    time.sleep(600)


def hang_outside_section() -> None:
    time.sleep(600)


def hang_before_first_heartbeat() -> None:
    time.sleep(600)


def segfault() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
    ctypes.string_at(0)


def exhaust_descriptors() -> None:
    """Open /dev/null until EMFILE; the error propagates (the files stay open until exit)."""
    held = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + 16, held + 16))
    files = []
    while True:
        files.append(open(os.devnull))  # noqa: SIM115 - held open on purpose


def exhaust_memory() -> None:
    """A limit 64 MiB above the address space in use, then 256 MiB asked for: MemoryError."""
    with open("/proc/self/statm") as f:
        in_use = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (in_use + 2**26, resource.RLIM_INFINITY))
    hoard = [bytearray(2**20) for _ in range(256)]
    print(f"rank {RANK}: {len(hoard)} MiB allocated past the limit", flush=True)


def start_spinners(count: int) -> None:
    """`count` children spinning on a core each; each dies with the rank (PR_SET_PDEATHSIG)."""
    for _ in range(count):
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            while True:
                pass


def load_batch(step: int) -> None:
    raise ValueError(f"batch {step} of rank {RANK} is corrupt")


def raises_here(args: argparse.Namespace, step: int) -> bool:
    if any(matches(spec, step) is not None for spec in args.raise_.split(",")):
        return True
    if args.raise_on_marked != step or os.environ.get("LOCAL_RANK", "0") != "0":
        return False
    return (args.ckpt_dir / f"fail-{os.environ.get('FTRUN_NODE')}").exists()


def inject(args: argparse.Namespace, step: int) -> None:
    if raises_here(args, step):
        print(f"rank {RANK}: raising at cycle {CYCLE} step {step}", flush=True)
        load_batch(step)
    specs = (args.exit, args.signal, args.segv, args.hang, args.out_of_fds, args.out_of_memory)
    if all(matches(spec, step) is None for spec in specs):
        return
    if args.fault_after:
        await_file(args.ckpt_dir / args.fault_after)
    print(f"rank {RANK}: injected fault at cycle {CYCLE} step {step}", flush=True)
    if (code := matches(args.exit, step)) is not None:
        os._exit(int(code))
    if (name := matches(args.signal, step)) is not None:
        os.kill(os.getpid(), signal.Signals[name])
        time.sleep(10)
    if matches(args.segv, step) is not None:
        segfault()
    if matches(args.hang, step) is not None:
        hang_in_step()
    if matches(args.out_of_fds, step) is not None:
        exhaust_descriptors()
    if matches(args.out_of_memory, step) is not None:
        exhaust_memory()


def go_stubborn(out: Path) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", IGNORE_TERM])
    escaped = subprocess.Popen([sys.executable, "-c", IGNORE_TERM], start_new_session=True)
    tmp = out / "stubborn-pids.tmp"
    tmp.write_text(f"{os.getpid()}\n{child.pid}\n{escaped.pid}\n")
    os.replace(tmp, out / "stubborn-pids")


def flood(client: RankMonitorClient, lock: threading.Lock, counter: list[int]) -> None:
    """Heartbeats as fast as one thread can send them, in bursts of 100 between which the
    training thread may take the lock (ZeroMQ sockets are not thread-safe, so the two threads
    share the client under a lock; without the yield, the lock would starve the trainer)."""
    while not STOP.is_set():
        with lock:
            for _ in range(100):
                client.send_heartbeat()
        counter[0] += 100
        time.sleep(0)


def garbage(address: str, counter: list[int]) -> None:
    """Random bytes, mutated valid frames, wrong frame counts, oversized frames."""
    import msgpack
    import zmq

    from ftrun.rank_monitor import protocol as wire

    valid = [
        wire.encode(m)
        for m in (
            wire.Hello(1, RANK + 100, 1),
            wire.Heartbeat(),
            wire.SectionStart("step"),
            wire.SectionEnd("step"),
            wire.EndAllSections(),
            wire.CalcTimeouts(2, True, None, True, True),
            wire.SetTimeouts(3, wire.Timeouts(0.001, 0.001, {"step": 0.001}, 0.001)),
            wire.Goodbye(),
        )
    ]
    rng = random.Random(RANK)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    while not STOP.is_set():
        choice = rng.random()
        if choice < 0.3:
            frames = [rng.randbytes(rng.randrange(0, 300))]
        elif choice < 0.4:
            junk = [1, "hb", None, -1, 2**63, 1.5, "x" * 300, {"a": [1]}, [], b"\x00"]
            frames = [msgpack.packb([rng.choice(junk) for _ in range(rng.randrange(0, 7))])]
        elif choice < 0.45:
            frames = [rng.choice(valid) for _ in range(rng.randrange(2, 4))]
        elif choice < 0.46:
            frames = [b"\x92" + b"x" * (wire.MAX_MESSAGE_BYTES + 10)]
        else:
            frame = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                pos = rng.randrange(0, len(frame))
                frame[pos] = rng.randrange(256)
            frames = [bytes(frame)]
        with contextlib.suppress(zmq.Again):
            sock.send_multipart(frames, zmq.NOBLOCK)
        counter[0] += 1
        if counter[0] % 200 == 0:
            time.sleep(0.005)
    sock.close()


def on_sigterm(_signum: int, _frame: object) -> None:
    global _stop_requested
    _stop_requested = True


def main() -> int:
    args = parse_args()
    out = args.ckpt_dir
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, on_sigterm)
    if matches(args.stubborn) is not None:
        go_stubborn(out)
    start_spinners(args.busy)
    if args.start_after:
        await_file(out / args.start_after)
    client = RankMonitorClient()
    client.init_workload_monitoring()
    if matches(args.hang_first_hb) is not None:
        print(f"rank {RANK}: injected hang before the first heartbeat", flush=True)
        hang_before_first_heartbeat()
    client.send_heartbeat()
    lock = threading.Lock()
    sent = [0]
    threads = []
    if args.flood:
        threads.append(threading.Thread(target=flood, args=(client, lock, sent), daemon=True))
    if args.garbage:
        address = os.environ["FTRUN_MONITOR_ADDR"]
        threads.append(threading.Thread(target=garbage, args=(address, sent), daemon=True))
    for thread in threads:
        thread.start()
    progress = (out / f"progress-rank{RANK}.txt").open("a")
    step = 0
    steps = args.first_cycle_steps if CYCLE == 0 and args.first_cycle_steps else args.steps
    for step in range(1, steps + 1):
        with lock:
            client.start_section("step")
        inject(args, step)
        time.sleep(args.step_time)
        with lock:
            client.end_section("step")
        if matches(args.hang_outside, step) is not None:
            print(f"rank {RANK}: injected hang outside sections at step {step}", flush=True)
            hang_outside_section()
        with lock:
            client.send_heartbeat()
        progress.write(f"{CYCLE} {step} {time.time():.6f}\n")
        progress.flush()
        if _stop_requested:
            (out / f"checkpoint-rank{RANK}").write_text(f"{CYCLE} {step}\n")
            print(f"rank {RANK}: checkpoint at step {step} on SIGTERM", flush=True)
            return 0
    STOP.set()
    for thread in threads:
        thread.join()
    with lock:
        client.shutdown_workload_monitoring()
    (out / f"done-rank{RANK}").write_text(f"{CYCLE}\n")
    print(f"rank {RANK}: finished at step {step} (sent {sent[0]} extra messages)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
