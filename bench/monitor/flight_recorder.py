"""What PyTorch's flight recorder (which ft_launcher turns on in every worker, 2000 entries)
adds to a collective: the same small all_reduce timed with TORCH_FR_BUFFER_SIZE=0 and =2000,
in fresh processes, interleaved, pair by pair.

One rank (world size 1) on NCCL when CUDA is there, and on gloo: the recorder's cost is per
call on the calling rank, so one rank shows it without the network. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

from bench.common import ROOT, smoke
from bench.common.harness import free_port

RANK = textwrap.dedent(
    """
    import json, os, statistics, sys
    import torch, torch.distributed as dist
    from bench.common.timing import per_call_us
    backend, calls = sys.argv[1], int(sys.argv[2])
    device = "cuda" if backend == "nccl" else "cpu"
    address = "tcp://127.0.0.1:" + sys.argv[3]
    dist.init_process_group(backend, rank=0, world_size=1, init_method=address)
    grads = torch.ones(1024, device=device)
    for _ in range(200):
        dist.all_reduce(grads)
    sync = torch.cuda.synchronize if device == "cuda" else None
    if sync is not None:
        sync()
    # the batch ends when the device has run it: the synchronize is timed with it
    costs = per_call_us(lambda: dist.all_reduce(grads), 20, max(1, calls // 20), settle=sync)
    print(json.dumps(statistics.median(costs)))
    dist.destroy_process_group()
    """
)


def one(backend: str, entries: int, calls: int, port: int) -> float:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": str(entries)}
    argv = [sys.executable, "-c", RANK, backend, str(calls), str(port)]
    out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=300)  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=4000)
    args = smoke.parse_args(parser, {"pairs": 1, "calls": 20})
    backends = ["nccl", "gloo"] if smoke.cuda_available() else ["gloo"]
    if backends == ["gloo"]:
        smoke.skip_gpu("flight_recorder", "NCCL (gloo only)")
    print("| backend | all_reduce of 1024 floats, recorder off (us) | on, 2000 entries (us) "
          "| on/off, pair by pair |")  # fmt: skip
    print("|---|---|---|---|")
    for backend in backends:
        off, on = [], []
        for _ in range(args.pairs):
            off.append(one(backend, 0, args.calls, free_port()))
            on.append(one(backend, 2000, args.calls, free_port()))
        ratios = sorted(b / a for a, b in zip(off, on, strict=True))
        print(f"| {backend} | {statistics.median(off):.2f} ({min(off):.2f}-{max(off):.2f}) | "
              f"{statistics.median(on):.2f} ({min(on):.2f}-{max(on):.2f}) | "
              f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) |")  # fmt: skip
    print(f"\nmedian (min-max) of {args.pairs} pairs of fresh processes, each the median of 20 "
          f"batches of {args.calls // 20} calls; world size 1")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
