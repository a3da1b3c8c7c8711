"""`make demo`: two local "nodes" x two gloo workers under ft_launcher, one crash, one hang.

Shows the launchers' own log lines (worker output is in the per-cycle logs), then a short
account of what happened, read from the events files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_cmd(work: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "ftrun.ft_launcher.cli",
        "--nnodes=2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=demo",
        "--max-restarts=3", f"--log-dir={work / 'logs'}",
        "--ft-rank-heartbeat-timeout=2", "--ft-rank-section-timeouts=step:5",
        str(HERE / "train_ddp.py"), "--ckpt-dir", str(work / "ckpt"),
        "--steps", "60", "--save-every", "10", "--step-time", "0.05",
        "--crash", "0:1:15",  # cycle 0: rank 1 exits with code 1 at step 15
        "--hang", "1:2:35",  # cycle 1: rank 2 stops inside its "step" section at step 35
    ]  # fmt: skip


def relay(name: str, proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("[ft_launcher") or "training finished" in line or "injected" in line:
            print(f"{name} | {line.rstrip()}", flush=True)


def story(log_dir: Path) -> None:
    events = []
    for path in sorted(log_dir.glob("events-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines()]
    events.sort(key=lambda e: e["ts"])
    start = events[0]["ts"]
    print("\nWhat happened (from the events files):")
    for e in events:
        if e["event"] in ("worker_exited", "hang", "stop_done", "rendezvous_done", "exit"):
            details = {k: v for k, v in e.items() if k not in ("ts", "mono", "node", "event")}
            if e["event"] == "worker_exited" and e["code"] == 0:
                continue
            print(f"  {e['ts'] - start:7.2f}s  {e['node']:<22} {e['event']:<16} {details}")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ftrun-demo-"))
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    print(f"demo directory: {work}\n")
    procs = [
        subprocess.Popen(
            launcher_cmd(work, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "SLURMD_NODENAME": f"node{i}"},
        )
        for i in range(2)
    ]
    relays = [threading.Thread(target=relay, args=(f"node{i}", p)) for i, p in enumerate(procs)]
    for thread in relays:
        thread.start()
    codes = [p.wait(timeout=600) for p in procs]
    for thread in relays:
        thread.join()
    story(work / "logs")
    finished = (work / "ckpt" / "FINISHED").exists()
    print(f"\nlauncher exit codes: {codes}; training finished: {finished}")
    print(f"events and per-cycle worker logs: {work / 'logs'}")
    report = [sys.executable, "-m", "ftrun.tools.cli", "report", str(work / "logs")]
    if subprocess.run([*report, "--out", str(work / "timeline.png")], check=False).returncode == 0:
        print(f"timeline picture: {work / 'timeline.png'}")
    return 0 if codes == [0, 0] and finished else 1


if __name__ == "__main__":
    sys.exit(main())
