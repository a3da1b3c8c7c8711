"""What ftrun's Lightning callbacks add to the step time of examples/lightning_train.py.

Each run is one `ft_launcher --standalone` node with `--nproc` DDP (gloo, CPU) ranks training the
example for `--steps` steps; rank 0 records the wall time between consecutive step ends
(`--timing`). Variants, interleaved run by run so that load drifts hit them alike:

- baseline: the example with `--no-ftrun` (Lightning, DDP and a ModelCheckpoint only);
- callbacks: + FaultToleranceCallback (sections, heartbeats) + PreemptionCallback (its stop
  vote) + HierarchicalCheckpointIO as the plugin, no local saves;
- +local saves: as callbacks, with a local checkpoint every 50 steps (mean: the saves count).

Global checkpoints and validation are off in every variant (they cost the same with or without
ftrun). Prints per variant the median and mean step time over all runs and the overhead, and
the time rank 0 spent inside the ftrun callbacks' per-step hooks (`on_train_batch_start/end`,
local saves included), measured in the worker by wrapping them: what they add to the training
path, whatever else loads the machine (one-off work at the start and end is not counted).
Usage: .venv/bin/python -m bench.monitor.lightning_overhead [--runs 3] [--steps 400] [--width 512]
[--nproc 2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT, smoke
from bench.common.timing import Stopwatch

MODULE = "bench.monitor.lightning_overhead"  # its own worker, run with `-m` from ROOT
EXAMPLE = ROOT / "examples" / "lightning_train.py"
RUN_TIMEOUT_S = 300
PREWARM = "torch,torch.distributed,pytorch_lightning"
PER_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")  # saves inside them count
SKIP_STEPS = 20  # warm-up: the first steps build DDP buckets and caches
VARIANTS = {
    "baseline": ["--no-ftrun"],
    "callbacks": ["--local-every", "0"],
    "+local saves/50": ["--local-every", "50"],
}


def run_once(
    work: Path, extra: list[str], args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    timing = work / "timing.json"
    cmd = [
        sys.executable, "-m", "ftrun.ft_launcher.cli", "--standalone",
        f"--nproc-per-node={args.nproc}",
        f"--log-dir={work / 'logs'}", f"--ft-prewarm-modules={PREWARM}",
        "--module", MODULE, "--worker", "--ckpt-dir", str(work / "ckpt"),
        "--max-steps", str(args.steps),
        "--save-every", str(10**9), "--val-every", str(10**9), "--width", str(args.width),
        "--batch-size", str(args.batch_size), "--timing", str(timing), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)  # fmt: skip
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise SystemExit(f"run {extra} took over {RUN_TIMEOUT_S}s") from None
    if code != 0:
        raise SystemExit(f"run {extra} exited {code}; logs in {work / 'logs'}")
    result = json.loads(timing.read_text())
    return result["intervals"][SKIP_STEPS:], result.get("hooks", [0.0])


def worker(argv: list[str]) -> int:
    """Runs the example in this worker with the ftrun callbacks' per-step hooks timed."""
    import importlib.util

    from ftrun.lightning import FaultToleranceCallback, LocalCheckpointCallback, PreemptionCallback

    calls: dict[str, list[float]] = {}

    def timed(key: str, fn: Any) -> Any:
        durations = calls.setdefault(key, [])

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            watch = Stopwatch()
            try:
                return fn(*args, **kwargs)
            finally:
                durations.append(watch.seconds())

        return wrapper

    for cls in (FaultToleranceCallback, PreemptionCallback, LocalCheckpointCallback):
        for name, fn in list(vars(cls).items()):
            if name in PER_STEP_HOOKS:
                setattr(cls, name, timed(f"{cls.__name__}.{name}", fn))
    spec = importlib.util.spec_from_file_location("lightning_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    code = example.main(argv)
    timing = Path(argv[argv.index("--timing") + 1])
    if os.environ.get("RANK", "0") == "0":
        used = [durations[SKIP_STEPS:] for durations in calls.values() if durations]
        per_step = [sum(step) for step in zip(*used, strict=False)] if used else [0.0]
        timing.write_text(json.dumps({**json.loads(timing.read_text()), "hooks": per_step}))
    return code


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (1: a core left idle)")
    sizes = {"runs": 1, "steps": SKIP_STEPS + 11, "width": 8, "batch_size": 8, "nproc": 1}
    args = smoke.parse_args(parser, sizes)
    if args.runs < 1 or args.steps <= SKIP_STEPS + 10:
        parser.error(f"--runs must be >= 1 and --steps > {SKIP_STEPS + 10}")
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    hooks: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-lightning-") as tmp:
        for run in range(args.runs):
            for name, extra in VARIANTS.items():
                work = Path(tmp) / f"{run}-{name.replace('/', '_')}"
                intervals, hook_times = run_once(work, extra, args)
                samples[name] += intervals
                hooks[name] += hook_times
                print(f"run {run + 1}/{args.runs} {name}: done", file=sys.stderr, flush=True)
    base = statistics.median(samples["baseline"])
    base_mean = statistics.fmean(samples["baseline"])
    print(
        f"\nexamples/lightning_train.py, 1 node x {args.nproc} rank(s) (gloo, CPU), "
        f"{os.cpu_count()} CPUs, width {args.width}, batch {args.batch_size}, "
        f"{args.runs} runs x {args.steps - SKIP_STEPS} steps"
    )
    print("| variant | median step | overhead | mean step | overhead "
          "| in ftrun hooks per step: median | mean |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, values in samples.items():
        med, mean = statistics.median(values), statistics.fmean(values)
        hook, hook_mean = statistics.median(hooks[name]), statistics.fmean(hooks[name])
        print(f"| {name} | {med * 1e3:.2f} ms | {100 * (med / base - 1):+.1f} % "
              f"| {mean * 1e3:.2f} ms | {100 * (mean / base_mean - 1):+.1f} % "
              f"| {hook * 1e6:.0f} us ({100 * hook / base:.2f} %) "
              f"| {hook_mean * 1e6:.0f} us ({100 * hook_mean / base_mean:.2f} %) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
