"""Where a compiled model's restart goes, with torch's caches warm (issue 40: a compiled job's
crash -> stepping <= 0.3x torchrun's), and what a prestarted worker could take off it.

`bench/workers/gpu_user_worker.py --compile` (the 151M DDP script, one rank, NCCL) runs once
unmeasured to fill inductor's and triton's caches (in a temporary TMPDIR and TRITON_CACHE_DIR),
then, round by round, as a new process would after a crash:

- `fresh`: `python script ...` started anew (what torchrun's restart and a plainly spawned
  worker pay);
- `context`: a process that imported torch, torch.distributed and torch._dynamo and made its
  CUDA context before the go (ftrun's prestarted worker today);
- `inductor`: that, and inductor's compiler modules imported too (`--preload`).

Each line: seconds from the go (the `fresh` process's start) to the script's `mark=ready`
(model, process group, DDP, optimizer) and to its first step (the compile, forward, backward),
then medians. `--profile` runs the last mode once more under cProfile and prints the top of
its cumulative times, and torch's own `compile_times`.

    python3 -m bench.restart.compile_restart_probe --rounds 3 --profile
    python3 -m bench.restart.compile_restart_probe --smoke   # one round (no CUDA: skipped)
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import WORKERS, smoke
from bench.common.harness import free_port

SCRIPT = WORKERS / "gpu_user_worker.py"
MODES = ("fresh", "context", "inductor")
BASE_IMPORTS = ("torch", "torch.distributed", "torch._dynamo")
PRELOAD = (
    "torch._inductor.compile_fx",
    "torch._functorch.aot_autograd",
    "torch._inductor.codecache",
    "torch._inductor.runtime.triton_heuristics",
)


def child(mode: str, argv: list[str], profile: bool) -> None:
    """Prepare as `mode` says, print `prepared`, wait for a line on stdin, run the script."""
    for name in BASE_IMPORTS + (PRELOAD if mode == "inductor" else ()):
        importlib.import_module(name)
    torch = sys.modules["torch"]
    with torch.cuda.device(0):
        pass
    print("prepared", flush=True)
    sys.stdin.readline()
    print(f"{time.time():.6f} go", flush=True)
    sys.argv = [str(SCRIPT), *argv]
    import runpy

    if not profile:
        runpy.run_path(str(SCRIPT), run_name="__main__")
        return
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(runpy.run_path, str(SCRIPT), run_name="__main__")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(45)
    print(torch._dynamo.utils.compile_times(repr="str"), flush=True)


def run_one(mode: str, env: dict[str, str], argv: list[str], profile: bool = False,
            echo: bool = False) -> dict[str, float]:  # fmt: skip
    """One new process of `mode`; seconds from the go to `ready` and to step 1."""
    env = {**env, "MASTER_PORT": str(free_port())}
    if mode == "fresh":
        cmd = [sys.executable, str(SCRIPT), *argv]
    else:
        cmd = [sys.executable, "-m", "bench.restart.compile_restart_probe", "--child", mode,
               *(["--profile"] if profile else []), "--", *argv]  # fmt: skip
    go = time.time()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    times: dict[str, float] = {}
    assert proc.stdout is not None and proc.stdin is not None
    for line in proc.stdout:
        if echo:
            print(line.rstrip(), flush=True)
        if line.startswith("prepared"):
            go = time.time()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            continue
        stamp, _, rest = line.partition(" ")
        if "mark=ready" in rest:
            times["ready"] = float(stamp) - go
        elif "step=1 " in rest and "first" not in times:
            times["first"] = float(stamp) - go
    if proc.wait() != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", choices=MODES[1:], help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = smoke.parse_args(parser, {"rounds": 1, "profile": False})
    if args.child:
        child(args.child, args.rest, args.profile)
        return
    if not smoke.cuda_available():
        smoke.skip_gpu("compile_restart_probe")
        return
    work = Path(tempfile.mkdtemp(prefix="compile-probe-"))
    env = {**os.environ, "TMPDIR": str(work), "TRITON_CACHE_DIR": str(work / "triton"),
           "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    argv = ["--compile", "--steps", "3", "--ckpt-every", "0", "--ckpt-dir", str(work / "ckpt")]
    try:
        t0 = time.time()
        filled = run_one("fresh", env, argv)
        print(f"cold (fills the caches): ready {filled['ready']:.2f} s, first step "
              f"{filled['first']:.2f} s (wall {time.time() - t0:.1f} s)", flush=True)  # fmt: skip
        modes = args.modes.split(",")
        seen: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        for round_no in range(1, args.rounds + 1):
            for mode in modes:
                times = run_one(mode, env, argv)
                seen[mode].append(times)
                print(f"round {round_no} {mode:9s} ready {times['ready']:6.2f} s  first step "
                      f"{times['first']:6.2f} s  compile+step "
                      f"{times['first'] - times['ready']:6.2f} s", flush=True)  # fmt: skip
        for mode in modes:
            ready = statistics.median(t["ready"] for t in seen[mode])
            first = statistics.median(t["first"] for t in seen[mode])
            print(f"MEDIAN {mode:9s} ready {ready:6.2f} s  first step {first:6.2f} s", flush=True)
        if args.profile:
            run_one(modes[-1] if modes[-1] != "fresh" else "context", env, argv, profile=True,
                    echo=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
