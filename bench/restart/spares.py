"""A node lost while a standby node waits: how long until training is back, side by side.

As a user would try hot spares: 3 launchers with `--nnodes=2` (2 workers each, the plain
`bench/workers/user_worker.py`, DDP on gloo, `--max-restarts=3`), so one launcher is left over.
After `--train-s` (20) s of training, the launcher of an active node that does not serve the
rendezvous store is SIGKILLed with its process group (its workers die with it, as when a
machine dies). Measured: the kill -> every rank has finished a step in a new process (in the
round that took the standby node in). Launchers: ft_launcher (standby nodes are hot spares),
torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (its c10d rendezvous admits waiting nodes
at the next round), NVRx's ft_launcher from bench/.nvrx-venv. Runs interleave; ratios are pair
by pair; the floor is `python -c "import torch"` (a new worker imports torch at least once).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import time

import psutil

from bench.common import smoke
from bench.common.jobs import (
    FT,
    NNODES,
    NVRX,
    SECTION_ARGS,
    TORCHRUN_NO_SHARE,
    USER_WORKER,
    Job,
    Launcher,
    import_torch_s,
    job,
    take_charge,
)
from bench.common.logs import user_all_stepping, user_pids
from bench.common.report import load_average, machine_line, progress, table

LAUNCHERS = {"ft": FT, "torchrun-noshare": TORCHRUN_NO_SHARE, "nvrx": NVRX}
STARTUP_WAIT_S = 180.0
RECOVERY_WAIT_S = 120.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--train-s", type=float, default=20.0, help="training before the loss")
    parser.add_argument("--launchers", nargs="+", choices=list(LAUNCHERS), default=list(LAUNCHERS))
    parser.add_argument("--markdown", action="store_true")
    return smoke.parse_args(parser, {"runs": 1, "train_s": 2.0, "launchers": ["ft"]})


def active_non_host(run: Job, training: set[int] | None = None) -> psutil.Process | None:
    """A launcher whose workers (`training`: by default, those that logged) train and that does
    not listen on the rendezvous port."""
    training = user_pids(run.out) if training is None else training
    for proc in run.procs:
        launcher = psutil.Process(proc.pid)
        family = [launcher, *launcher.children(recursive=True)]
        listens = any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == run.port
            for p in family
            for c in _connections(p)
        )
        if not listens and {p.pid for p in family} & training:
            return launcher
    return None


def _connections(proc: psutil.Process) -> list:
    with contextlib.suppress(psutil.Error):
        return proc.net_connections(kind="tcp")
    return []


def one_run(launcher: Launcher, train_s: float) -> tuple[float | None, str]:
    """Seconds from the loss to every rank stepping again; None and why if it did not."""
    steps = int((train_s + 200.0) / 0.05)
    client = {FT: "ftrun", NVRX: "nvrx"}.get(launcher, "none")
    worker = ["--client", client, "--steps", str(steps)]
    extra = [f"--nnodes={NNODES}", *(SECTION_ARGS if client != "none" else ())]
    with job(launcher, extra, worker, USER_WORKER, launchers=NNODES + 1) as run:
        stepping = run.wait(lambda: user_all_stepping(run.out), STARTUP_WAIT_S)
        if stepping is None:
            return None, "start-up failed"
        time.sleep(max(0.0, stepping + train_s - time.time()))
        victim = active_non_host(run)
        if victim is None:
            return None, "no active launcher without the store"
        before = frozenset(user_pids(run.out))
        lost_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGKILL)
        back = run.wait(lambda: user_all_stepping(run.out, lost_at, before), RECOVERY_WAIT_S)
        if back is None:
            run.keep = True
            return None, f"not back within {RECOVERY_WAIT_S:.0f}s ({run.tmp})"
        return back - lost_at, ""


def main() -> None:
    args = parse_args()
    take_charge()
    load_before = load_average()
    launchers = {k: LAUNCHERS[k] for k in args.launchers if LAUNCHERS[k].available}
    results: dict[str, list[float | None]] = {k: [] for k in launchers}
    floor = []
    for run in range(1, args.runs + 1):
        floor.append(import_torch_s())
        for key, launcher in launchers.items():
            seconds, why = one_run(launcher, args.train_s)
            results[key].append(seconds)
            progress(f"run {run} {key}: {seconds if seconds is not None else why}")
    rows = []
    for key, values in results.items():
        done = [v for v in values if v is not None]
        median = f"{statistics.median(done):.2f}" if done else "-"
        pairs = [
            f / p
            for f, p in zip(results["ft"], values, strict=True)
            if f is not None and p is not None
        ]
        ratio = f"{statistics.median(pairs):.2f}x" if pairs and key != "ft" else ""
        rows.append([key, median, f"{len(done)}/{len(values)}", ratio])
    print(machine_line(load_before))
    print(f"floor: import torch {statistics.median(floor):.2f} s (median of {len(floor)})")
    headers = ["launcher", "loss -> stepping (s, median)", "recovered", "ft / it"]
    print(table(headers, rows, args.markdown))


if __name__ == "__main__":
    main()
