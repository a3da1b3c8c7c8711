"""Run the fault matrix N times and print one markdown table (what `make faults` runs).

    python tests/faults/run_matrix.py [--repeats N] [--backend c10d|etcd|store] [--out FILE]
                                      [--logs DIR] [-- PYTEST_ARGS]

Each pass runs `pytest tests/faults` with FTRUN_FAULTS_REPORT set, so every case appends one
JSON line (see tests/faults/conftest.py), and FTRUN_FAULTS_BACKEND set to --backend (default:
$FTRUN_FAULTS_BACKEND, else c10d): on etcd every pass starts one 3-member etcd cluster on
127.0.0.1 for all its cases. The table's first line names the backend, then one row per case:
the documented outcome (or why it does not apply on this backend), the median of its measured
time over the runs that passed, and the flakes (runs in which it failed). Each pass's pytest
output and JSON lines are kept under --logs. The exit status is 1 when any case failed in any
run, when a pass's pytest failed without recording a failed case (a collection error, say), or
when a case recorded another backend than the one asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ON_BACKEND = {
    "c10d": "the first agent serves a TCPStore",
    "etcd": "a 3-member etcd cluster on 127.0.0.1, one per pass; no node hosts the store",
    "store": "c10d served by `ftrun store`, one per pass; no node hosts the store, and the "
    "launchers reconnect (--ft-store-reconnect-timeout=30)",
}
FLAG = {"store": "c10d"}
"""The launchers' --rdzv-backend where it is not the backend's name."""
BAD = {"failed", "error"}
BACKENDS = ("c10d", "etcd", "store")
BACKEND_ENV = "FTRUN_FAULTS_BACKEND"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=int(os.environ.get("FAULT_REPEATS", "3")))
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=os.environ.get(BACKEND_ENV) or "c10d",
        help="the launchers' store (etcd: a 3-member etcd cluster per pass; store: ftrun store)",
    )
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument(
        "--logs", type=Path, help="keep each pass's pytest output here (default: a new tmp dir)"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="ftrun-faults-"))
    logs.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    passes: list[tuple[float, int]] = []
    for run in range(1, args.repeats + 1):
        report = logs / f"pass{run}.jsonl"
        report.unlink(missing_ok=True)
        started = time.monotonic()
        code = run_pytest(report, logs / f"pass{run}.log", args.backend, args.pytest_args)
        elapsed = time.monotonic() - started
        found = read(report, run)
        records += found
        passes.append((elapsed, code))
        failed = sorted(r["case"] for r in found if r["outcome"] in BAD)
        print(
            f"pass {run}/{args.repeats}: pytest exit {code}, {len(found)} cases, "
            f"{elapsed:.1f}s" + (f", FAILED: {', '.join(failed)}" if failed else ""),
            flush=True,
        )
    table = render(records, passes, args.repeats, args.backend)
    print(table)
    print(f"pytest output and JSON lines of every pass: {logs}")
    if args.out:
        args.out.write_text(table)
    any_failed = any(r["outcome"] in BAD for r in records)
    unexplained = any(code != 0 for _, code in passes) and not any_failed
    elsewhere = sorted({r.get("backend") for r in records} - {args.backend}, key=str)
    if elsewhere:
        print(f"cases recorded on another backend than {args.backend}: {elsewhere}")
    return 1 if any_failed or unexplained or elsewhere or not records else 0


def run_pytest(report: Path, log: Path, backend: str, extra: list[str]) -> int:
    env = {**os.environ, "FTRUN_FAULTS_REPORT": str(report), BACKEND_ENV: backend}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults", *extra]
    with log.open("w") as out:
        return subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode


def read(report: Path, run: int) -> list[dict]:
    if not report.exists():
        return []
    return [{**json.loads(line), "run": run} for line in report.read_text().splitlines()]


def render(
    records: list[dict], passes: list[tuple[float, int]], repeats: int, backend: str = "c10d"
) -> str:
    cases: dict[str, list[dict]] = {}
    for record in records:
        cases.setdefault(record["case"], []).append(record)
    where = ON_BACKEND.get(backend, backend)
    lines = [
        f"Rendezvous backend: {backend} (`--rdzv-backend={FLAG.get(backend, backend)}`, {where}).",
        "",
        "| case | outcome | median time (s) | median to stepping again (s) | flakes |",
        "|---|---|---|---|---|",
    ]
    for case, runs in cases.items():
        ok = [r for r in runs if r["outcome"] not in BAD]
        outcome = next((r["expect"] for r in runs if r["expect"]), "?")
        if any(r["outcome"] == "xfailed" for r in runs):
            outcome += " (xfail: src bug)"
        if all(r["outcome"] == "skipped" for r in runs):
            outcome = f"skipped: {outcome}"
        flakes = len(runs) - len(ok)
        lines.append(
            f"| {case} | {outcome} | {_median(ok, 'seconds')} | {_median(ok, 'stepping')} "
            f"| {flakes}/{len(runs)} |"
        )
    walls = [elapsed for elapsed, _ in passes]
    lines += [
        "",
        f"{repeats} pass(es); per pass: median {statistics.median(walls):.1f}s, "
        f"max {max(walls):.1f}s. Time: recovered cases, detection (first hang verdict or failed "
        "worker exit, events' `ts`) to every worker of the next cycle started; exit cases, the "
        "last failure (or the kill/signal) to the last launcher's `exit` event; bad config, "
        "launcher start to exit; misbehaving clients, workers started to exit.",
    ]
    return "\n".join(lines) + "\n"


def _median(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    return f"{statistics.median(values):.3f}" if values else "-"


if __name__ == "__main__":
    sys.exit(main())
