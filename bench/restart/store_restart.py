"""The job's rendezvous store SIGKILLed and started again at once: how long until training again.

As a user runs a job with its store off the training nodes: `--nnodes` (2) launchers ("nodes")
x 1 worker on this host, each worker the plain `bench/workers/user_worker.py` (DDP on gloo, a
checkpoint every 100 steps) or, with `--worker gpu`, `bench/workers/gpu_user_worker.py` (151M
transformer, DDP over NCCL, `torch.save` every 10 steps; one GPU holds one rank, so `--nnodes
1` there). The store is a process of its own on 127.0.0.1:P, and at each `--faults` time (s
since the job first stepped: 10 and 40) the bench SIGKILLs it and starts it again on the same
port. Measured: the kill -> every rank has finished a step in a new process. Contenders:

- `ftrun`: ft_launcher with `--ft-store-reconnect-timeout=30`, the store `ftrun store --port P`.
  The agents reconnect, write the job's state back and restart the cycle in the same job;
- `torchrun`: `--rdzv-conf=is_host=false`, the store the same `ftrun store` command (a plain
  c10d TCPStore; torch's c10d backend then connects as a client, see `_create_tcp_store`). Its
  agents cannot survive the store's loss: the job ends, and the bench relaunches it as a user's
  sbatch loop would (same command, same rendezvous id and checkpoint) once every launcher exited;
- `nvrx`: NVRx 0.7.0's ft_launcher with `--rdzv-conf=is_host=false`, the store its own external
  store process `nvrx-control` (its barrier rendezvous needs the store host to close rounds, so a
  bare TCPStore would not do); relaunched as torchrun is. Where NVRx is installed (the device).

Columns: the cold start (launch -> every rank stepping: the relaunch floor), the store back
(kill -> the new store listening), the job ended (kill -> the last launcher exited; relaunched
contenders), and kill -> stepping per fault. The floor: `python -c "import torch"` and one
TCPStore client connect to a fresh store. Runs interleave, the contender that goes first rotates,
ratios are pair by pair (run i over run i). Raw results: bench/out/store-restart-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from bench.common import OUT, WORKERS, smoke
from bench.common.jobs import (
    FT,
    NVRX,
    NVRX_BIN,
    TORCHRUN,
    USER_WORKER,
    VENV_BIN,
    Job,
    Launcher,
    free_port,
    import_torch_s,
    job,
    take_charge,
)
from bench.common.logs import user_all_stepping, user_pids
from bench.common.report import (
    Stats,
    load_average,
    machine_line,
    pair_ratios,
    progress,
    ratio_cell,
    table,
)
from bench.common.timing import Stopwatch

GPU_WORKER = WORKERS / "gpu_user_worker.py"
FTRUN_STORE = (str(VENV_BIN / "python"), "-m", "ftrun.tools.cli", "store")
NVRX_CONTROL = (
    str(NVRX_BIN / "python"),
    "-c",
    "from nvidia_resiliency_ext.fault_tolerance.control_plane import main; main()",
)
STORE_UP_WAIT_S = 60.0
STARTUP_WAIT_S = 240.0
RECOVERY_WAIT_S = 180.0
MIN_TRAIN_S = 3.0  # training between a recovery and the next fault, at least


@dataclasses.dataclass(frozen=True)
class Contender:
    """A launcher, its flags for an external store, and whether it recovers in the same job."""

    key: str
    launcher: Launcher
    args: tuple[str, ...]
    in_job: bool

    def store_argv(self, port: int, run_id: str, nnodes: int) -> list[str]:
        if self.key == "nvrx":  # NVRx's own control process: it closes the rendezvous rounds
            rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
            return [*NVRX_CONTROL, *rdzv, f"--rdzv-id={run_id}", f"--nnodes={nnodes}",
                    "--ft-enable-log-server=false"]  # fmt: skip
        return [*FTRUN_STORE, "--port", str(port)]


NOT_HOST = ("--rdzv-conf=is_host=false",)
CONTENDERS = {
    c.key: c
    for c in (
        Contender("ftrun", FT, ("--ft-store-reconnect-timeout=30",), in_job=True),
        Contender("torchrun", TORCHRUN, NOT_HOST, in_job=False),
        Contender("nvrx", NVRX, NOT_HOST, in_job=False),
    )
}


@dataclasses.dataclass
class Outcome:
    """One run of one contender; per fault: store back, job ended, stepping again (s from kill)."""

    contender: str
    run: int
    cold_s: float | None = None
    store_back: list[float] = dataclasses.field(default_factory=list)
    ended: list[float | None] = dataclasses.field(default_factory=list)
    back: list[float | None] = dataclasses.field(default_factory=list)
    exit_codes: list[list[int | None]] = dataclasses.field(default_factory=list)
    load: list[float] = dataclasses.field(default_factory=list)  # 1-min load at each kill
    note: str = ""


class StoreProcess:
    """One store process at a time on 127.0.0.1:`port`; its output is appended to `log`."""

    def __init__(self, argv: Sequence[str], port: int, log: Path) -> None:
        self.argv, self.port, self.log = list(argv), port, log
        self.proc = self._start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            return subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _start(self) -> subprocess.Popen[bytes]:
        proc = self._spawn()
        deadline = time.monotonic() + STORE_UP_WAIT_S
        while not self._listening(proc.pid):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"store {self.argv} did not serve: {self.log}")
            time.sleep(0.02)
        return proc

    def up(self) -> bool:
        """Listening: what the launchers need, no more."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"store {self.argv} exited: {self.log}")
        return self._listening(self.proc.pid)

    def _listening(self, pid: int) -> bool:
        with contextlib.suppress(psutil.Error):
            conns = psutil.Process(pid).net_connections(kind="tcp")
            return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in conns)
        return False

    def restart(self) -> float:
        """SIGKILL it (its keys are lost) and start it again on the same port, without waiting
        for it to listen (`up`); returns when the old one died (wall time)."""
        self.proc.kill()
        self.proc.wait(10)
        killed_at = time.time()
        self.proc = self._spawn()
        return killed_at

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", type=float, nargs="+", default=[10.0, 40.0],
                        help="store kills, s after the job first stepped")  # fmt: skip
    parser.add_argument("--worker", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--nnodes", type=int, default=2, help="launchers, 1 worker each")
    parser.add_argument(
        "--launchers", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS)
    )
    parser.add_argument("--startup-wait", type=float, default=STARTUP_WAIT_S, help="s")
    parser.add_argument("--json", type=Path, help="default: bench/out/store-restart-<time>.json")
    parser.add_argument("--from-json", type=Path, help="tabulate this raw file; run nothing")
    parser.add_argument("--markdown", action="store_true")
    sizes = {"runs": 1, "faults": [2.0], "launchers": ["ftrun"], "startup_wait": 120.0}
    return smoke.parse_args(parser, sizes)


def worker_args(kind: str, scratch: Path) -> tuple[Path, list[str]]:
    """The script and its arguments: one output and checkpoint place for the job and any
    relaunch of it (later flags win over `start_job`'s `--out`)."""
    out = ["--out", str(scratch / "out")]
    if kind == "gpu":
        return GPU_WORKER, [*out, "--ckpt-dir", str(scratch / "ckpt"), "--steps", "1000000"]
    return USER_WORKER, [*out, "--client", "none", "--steps", "1000000"]


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ftrun-bench-store-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---- one run -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One contender's job through its faults: the store, the job and any relaunch of it."""

    contender: Contender
    args: argparse.Namespace
    scratch: Path
    stack: contextlib.ExitStack
    outcome: Outcome
    store: StoreProcess | None = None

    @property
    def out(self) -> Path:
        return self.scratch / "out"

    def launch(self) -> Job:
        """The job's command, the same for its first launch and every relaunch."""
        assert self.store is not None
        script, wargs = worker_args(self.args.worker, self.scratch)
        extra = [f"--nnodes={self.args.nnodes}", "--nproc-per-node=1",
                 f"--rdzv-endpoint=127.0.0.1:{self.store.port}", f"--rdzv-id={self.scratch.name}",
                 *self.contender.args]  # fmt: skip
        launcher, nodes = self.contender.launcher, self.args.nnodes
        return self.stack.enter_context(job(launcher, extra, wargs, script, launchers=nodes))

    def stepping(self, current: Job, since: float = 0.0, old: frozenset[int] = frozenset()):
        world = self.args.nnodes
        return current.wait(lambda: user_all_stepping(self.out, since, old, world), RECOVERY_WAIT_S)

    def store_and_job(self, current: Job) -> tuple[float, float | None]:
        """When the new store listened and (relaunched contenders) when the last launcher exited,
        watched together: neither waits on the other. None: the job had not ended in time."""
        store_up = ended = None
        deadline = time.monotonic() + RECOVERY_WAIT_S
        while time.monotonic() < deadline:
            now = time.time()
            store_up = store_up or (now if self.store.up() else None)
            ended = ended or (None if current.running() else now)
            if store_up and (ended or self.contender.in_job):
                break
            time.sleep(0.02)
        if store_up is None:
            raise RuntimeError(f"the store did not come back: {self.store.log}")
        return store_up, ended

    def fault(self, current: Job, at_wall: float) -> Job | None:
        """Kill and restart the store at `at_wall`; the job (relaunched where it ended) once every
        rank steps again, or None (the outcome's note says why)."""
        time.sleep(max(0.0, at_wall - time.time()))
        before = frozenset(user_pids(self.out, world=self.args.nnodes))
        assert self.store is not None
        killed_at = self.store.restart()
        self.outcome.load.append(os.getloadavg()[0])  # the VM is shared: how busy, per fault
        store_up, ended = self.store_and_job(current)
        self.outcome.store_back.append(store_up - killed_at)
        if self.contender.in_job:
            self.outcome.ended.append(None)
        else:  # as an sbatch loop: the same command again once the last launcher exited
            self.outcome.ended.append(None if ended is None else ended - killed_at)
            self.outcome.exit_codes.append(current.exit_codes())
            if ended is None:
                self.outcome.note = f"the job did not end within {RECOVERY_WAIT_S:.0f} s"
                self.outcome.back.append(None)
                return None
            current = self.launch()
        back = self.stepping(current, killed_at, before)
        self.outcome.back.append(None if back is None else back - killed_at)
        if back is None:
            self.outcome.note = "not stepping again: " + current.describe()
            return None
        if self.contender.in_job and not all(c is None for c in current.exit_codes()):
            self.outcome.note = f"stepping, but launchers exited: {current.exit_codes()}"
        return current


def one_run(contender: Contender, args: argparse.Namespace, number: int) -> Outcome:
    outcome = Outcome(contender.key, number)
    with scratch_dir() as scratch, contextlib.ExitStack() as stack:
        run = Run(contender, args, scratch, stack, outcome)
        port = free_port()
        argv = contender.store_argv(port, scratch.name, args.nnodes)
        run.store = StoreProcess(argv, port, scratch / "store.log")
        stack.callback(run.store.stop)  # after every job of the run (they kill it too)
        current: Job | None = run.launch()
        first = current.wait(
            lambda: user_all_stepping(run.out, world=args.nnodes), args.startup_wait
        )
        if first is None:
            store_tail = run.store.log.read_text(errors="replace").splitlines()[-3:]
            outcome.note = f"start-up failed: {current.describe()}\n--- store: {store_tail}"
            return outcome
        outcome.cold_s = first - current.launched_at
        for at in args.faults:
            last = max(first + at, time.time() + MIN_TRAIN_S)
            current = run.fault(current, last)
            if current is None:
                break
    return outcome


# ---- the floor and the report --------------------------------------------------------------------


def store_connect_ms() -> float:
    """One TCPStore client's connect to a fresh store on 127.0.0.1 (what a reconnect costs at
    least, torch imported)."""
    import datetime

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    started = Stopwatch()
    client = TCPStore("127.0.0.1", server.port, is_master=False,
                      timeout=datetime.timedelta(seconds=10))  # fmt: skip
    took = started.seconds() * 1e3
    del client, server
    return took


def cell(values: Sequence[float | None], fmt: str = "{:.2f}") -> str:
    stats = Stats.of(values)
    return stats.cell(fmt) if stats else "-"


def rows_of(outcomes: list[Outcome], keys: list[str], faults: list[float]) -> list[list[str]]:
    rows = []
    for key in keys:
        mine = [o for o in outcomes if o.contender == key]
        per_fault = [
            [o.back[i] if i < len(o.back) else None for o in mine] for i in range(len(faults))
        ]
        ended = [e for o in mine for e in o.ended if e is not None]
        recovered = sum(v is not None for vs in per_fault for v in vs)
        row = [key, cell([o.cold_s for o in mine]), cell([s for o in mine for s in o.store_back])]
        row += [cell(ended) if ended else "in-job", *(cell(v) for v in per_fault)]
        # The launcher's own part: from the new store listening to stepping, every fault.
        after = [
            b - s for o in mine for b, s in zip(o.back, o.store_back, strict=True) if b is not None
        ]
        rows.append([*row, cell(after), f"{recovered}/{len(mine) * len(faults)}"])
    return rows


def ratio_rows(outcomes: list[Outcome], keys: list[str], faults: list[float]) -> list[list[str]]:
    def by_run(key: str, i: int) -> dict[int, float | None]:
        return {
            o.run: o.back[i] if i < len(o.back) else None for o in outcomes if o.contender == key
        }

    rows = []
    for peer in [k for k in keys if k != "ftrun" and "ftrun" in keys]:
        cells = [
            ratio_cell(pair_ratios(by_run("ftrun", i), by_run(peer, i))) for i in range(len(faults))
        ]
        rows.append([f"ftrun / {peer}", *cells])
    return rows


def report(args: argparse.Namespace, outcomes: list[Outcome], keys: list[str], floor: dict) -> None:
    faults = [f"kill at {at:.0f} s -> stepping" for at in args.faults]
    headers = ["launcher", "cold start", "store back", "job ended", *faults]
    headers += ["store up -> stepping", "recovered"]
    print(table(headers, rows_of(outcomes, keys, args.faults), args.markdown))
    ratios = ratio_rows(outcomes, keys, args.faults)
    if ratios:  # none with ftrun alone (a peer not installed, or --launchers ftrun)
        print()
        print(table(["pair by pair", *faults], ratios, args.markdown))
    print(f"\nfloor: import torch {cell(floor['import_torch_s'])} s; TCPStore client connect "
          f"{cell(floor['connect_ms'], '{:.1f}')} ms; 1-min load at the kills "
          f"{cell([x for o in outcomes for x in o.load], '{:.1f}')}")  # fmt: skip
    for o in outcomes:
        if o.note or o.exit_codes:
            print(f"run {o.run} {o.contender}: exit codes {o.exit_codes} {o.note[:600]}")


def from_json(args: argparse.Namespace) -> None:
    raw = json.loads(args.from_json.read_text())
    outcomes = [Outcome(**o) for o in raw["outcomes"]]
    keys = list(dict.fromkeys(o.contender for o in outcomes))
    args.faults = [float(f) for f in raw["args"]["faults"].strip("[]").split(",")]
    report(args, outcomes, keys, raw["floor"])


def main() -> None:
    args = parse_args()
    if args.from_json:
        from_json(args)
        return
    take_charge()
    load_before = load_average()
    keys = [k for k in args.launchers if CONTENDERS[k].launcher.available]
    outcomes: list[Outcome] = []
    path = args.json or OUT / f"store-restart-{time.strftime('%Y%m%d-%H%M%S')}.json"
    floor: dict[str, list[float]] = {"import_torch_s": [], "connect_ms": []}
    for number in range(1, args.runs + 1):
        floor["import_torch_s"].append(import_torch_s())
        floor["connect_ms"].append(store_connect_ms())
        turn = (number - 1) % len(keys)
        for key in keys[turn:] + keys[:turn]:  # who goes first rotates
            outcome = one_run(CONTENDERS[key], args, number)
            outcomes.append(outcome)
            save(path, args, outcomes, floor)
            progress(f"run {number} {key}: cold {outcome.cold_s} back {outcome.back} "
                     f"ended {outcome.ended} {outcome.note[:300]}")  # fmt: skip
    print(machine_line(load_before))
    report(args, outcomes, keys, floor)
    progress(f"raw results: {path}")


def save(path: Path, args: argparse.Namespace, outcomes: list[Outcome], floor: dict) -> None:
    """After every run: a run cut short still leaves what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = {"args": {k: str(v) for k, v in vars(args).items()}, "floor": floor,
           "outcomes": [dataclasses.asdict(o) for o in outcomes]}  # fmt: skip
    path.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
