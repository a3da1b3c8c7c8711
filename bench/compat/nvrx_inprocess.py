"""NVRx 0.7's in-process examples under ftrun, with only their import line changed (issue 39).

    python -m bench.compat.nvrx_inprocess [--examples <NVRx checkout>/examples] [--runs N]
        [--iterations 1000] [--json out.json] [--smoke]

`examples/inprocess/basic_example.py` and `advanced_example.py` (`import
nvidia_resiliency_ext.inprocess as inprocess` -> `import ftrun.inprocess as inprocess`) run on
the CPU (`--device cpu --fault-prob 0.004`, no `--seed`: with a fixed seed an example draws the
same fault again after each rollback to the same checkpoint, under NVRx too), 2 ranks, under
`ft_launcher` and under `torchrun`, interleaved run by run. Each row: the launcher, the exit
code, the faults the example raised and recovered (its own "restart latency" lines), the
launcher cycles (ft_launcher's "workers forked" lines: 1 means no cycle after the first), and
the median restart latency as the example measures it (its raise -> its function entered again
on the raising rank).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, smoke
from bench.common.jobs import free_port

IMPORT = (
    "import nvidia_resiliency_ext.inprocess as inprocess",
    "import ftrun.inprocess as inprocess",
)
EXAMPLES = ("basic_example.py", "advanced_example.py")
LATENCY = re.compile(r"restart latency: ([0-9.]+)s")


def prepare(examples: Path, work: Path) -> list[Path]:
    scripts = []
    for name in EXAMPLES:
        text = (examples / "inprocess" / name).read_text()
        if IMPORT[0] not in text:
            raise SystemExit(f"nvrx_inprocess: {name} changed: {IMPORT[0]!r} not found")
        target = work / name
        target.write_text(text.replace(IMPORT[0], IMPORT[1]))
        scripts.append(target)
    return scripts


def command(launcher: str, script: Path, ckpt: Path, iterations: int) -> list[str]:
    args = [str(script), "--device", "cpu", "--fault-prob", "0.004", "--total-iterations",
            str(iterations), "--path", str(ckpt), "--log-interval", "1000000"]  # fmt: skip
    endpoint = f"--rdzv-endpoint=127.0.0.1:{free_port()}"
    module = "ftrun.ft_launcher.cli" if launcher == "ft_launcher" else "torch.distributed.run"
    return [sys.executable, "-m", module, "--nproc-per-node=2", "--rdzv-backend=c10d",
            endpoint, *args]  # fmt: skip


def run_one(launcher: str, script: Path, work: Path, iterations: int) -> dict[str, object]:
    ckpt = Path(tempfile.mkdtemp(dir=work, prefix="ckpt-"))
    done = subprocess.run(command(launcher, script, ckpt, iterations), capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    text = done.stdout + done.stderr
    latencies = [float(x) for x in LATENCY.findall(text)]
    cycles = text.count("workers forked") if launcher == "ft_launcher" else None
    row = {"example": script.name, "launcher": launcher, "rc": done.returncode,
           "faults_recovered": len(latencies), "cycles": cycles,
           "median_latency_s": round(statistics.median(latencies), 3) if latencies else None,
           "latencies_s": latencies}  # fmt: skip
    print(f"{script.name:<22} {launcher:<12} rc={done.returncode} faults={len(latencies):<3} "
          f"cycles={cycles} median={row['median_latency_s']}", flush=True)  # fmt: skip
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=Path, default=ROOT / ".nvrx" / "examples")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = smoke.parse_args(parser, {"runs": 1, "iterations": 300})
    if not (args.examples / "inprocess").is_dir():
        print(f"nvrx_inprocess: no NVRx examples at {args.examples}: skipped")
        return 0
    work = Path(tempfile.mkdtemp(prefix="nvrx-inprocess-"))
    rows = []
    for _ in range(args.runs):
        for script in prepare(args.examples, work):
            for launcher in ("ft_launcher", "torchrun"):
                rows.append(run_one(launcher, script, work, args.iterations))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
