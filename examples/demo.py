"""`make demo`: two local "nodes" x two gloo workers under ft_launcher, and a third node standing
by as a hot spare. One crash (restored from node memory), one hang, then a node lost (its
launcher and workers SIGKILLed): the spare takes its place and its ranks restore from the
replicas the lost node's peer holds.

Shows the launchers' own log lines (worker output is in the per-cycle logs), then a short
account of what happened, read from the events files.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_cmd(work: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "ftrun.ft_launcher.cli",
        "--nnodes=2", "--nproc-per-node=2",  # 3 launchers: one stands by
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=demo",
        "--max-restarts=3", f"--log-dir={work / 'logs'}",
        # train_ddp.py builds DDP and an optimizer (each imports torch._dynamo): the fork server
        # imports it once a node, before the first cycle, not every first-cycle worker.
        "--ft-prewarm-modules=torch,torch.distributed,torch._dynamo",
        "--ft-rank-heartbeat-timeout=2", "--ft-rank-section-timeouts=step:5",
        str(HERE / "train_ddp.py"), "--ckpt-dir", str(work / "ckpt"),
        "--steps", "90", "--save-every", "30", "--step-time", "0.05",
        "--local-ckpt-every", "2",  # each rank's part, in node memory, replicated
        "--crash", "0:1:15",  # cycle 0: rank 1 exits with code 1 at step 15
        "--hang", "1:2:35",  # cycle 1: rank 2 stops inside its "step" section at step 35
    ]  # fmt: skip


def relay(name: str, proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("[ft_launcher") or "training finished" in line or "injected" in line:
            print(f"{name} | {line.rstrip()}", flush=True)


def events(log_dir: Path) -> list[dict]:
    found = []
    for path in sorted(log_dir.glob("events-*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda e: e["ts"])


def lose_a_node(log_dir: Path, procs: dict[str, subprocess.Popen[str]]) -> None:
    """Once cycle 2 trains, SIGKILL an active node that does not serve the store."""
    while all(p.poll() is None for p in procs.values()):
        seen = events(log_dir)
        if any(e["event"] == "stepping" and e["cycle"] >= 2 for e in seen):
            rounds = [e for e in seen if e["event"] == "rendezvous_done" and e["cycle"] >= 2]
            hosts = {e["node"] for e in seen if e.get("store_host")}
            victim = next(n for n in rounds[-1]["nodes"] if n not in hosts)
            print(f"demo | losing {victim}: SIGKILL to its launcher and workers", flush=True)
            os.killpg(procs[victim].pid, signal.SIGKILL)
            return
        time.sleep(0.2)


def story(log_dir: Path) -> None:
    seen = events(log_dir)
    start = seen[0]["ts"]
    shown = ("worker_exited", "hang", "stop_done", "rendezvous_done", "standby", "ckpt_restore",
             "exit")  # fmt: skip
    print("\nWhat happened (from the events files):")
    for e in seen:
        if e["event"] in shown:
            details = {k: v for k, v in e.items() if k not in ("ts", "mono", "node", "event")}
            if e["event"] == "worker_exited" and e["code"] == 0:
                continue
            print(f"  {e['ts'] - start:7.2f}s  {e['node']:<22} {e['event']:<16} {details}")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ftrun-demo-"))
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    print(f"demo directory: {work}\n")
    procs = {
        f"node{i}": subprocess.Popen(
            launcher_cmd(work, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "SLURMD_NODENAME": f"node{i}"},
            start_new_session=True,  # its own process group: the demo can lose it whole
        )
        for i in range(3)
    }
    relays = [threading.Thread(target=relay, args=item) for item in procs.items()]
    for thread in relays:
        thread.start()
    lose_a_node(work / "logs", procs)
    codes = [p.wait(timeout=600) for p in procs.values()]
    for thread in relays:
        thread.join()
    story(work / "logs")
    finished = (work / "ckpt" / "FINISHED").exists()
    print(f"\nlauncher exit codes: {codes}; training finished: {finished}")
    print(f"events and per-cycle worker logs: {work / 'logs'}")
    report = [sys.executable, "-m", "ftrun.tools.cli", "report", str(work / "logs")]
    if subprocess.run([*report, "--out", str(work / "timeline.png")], check=False).returncode == 0:
        print(f"timeline picture: {work / 'timeline.png'}")
    return 0 if sorted(codes) == [-signal.SIGKILL, 0, 0] and finished else 1


if __name__ == "__main__":
    sys.exit(main())
