"""On a GPU node: does `--numa-binding` bind the workers where NVML says their GPU is?

For each mode (node, socket, exclusive), one ft_launcher job of `--nproc-per-node` workers
(default: every GPU) whose rank 0 fails once, so that each local rank runs twice: plainly
spawned or forked in the first cycle, forked in the restart. Each worker records its CPU affinity
(`os.sched_getaffinity`) and its `Mems_allowed_list`; the script compares them with NVML's
affinity of the worker's GPU, read here through pynvml, and prints one line per worker and cycle.
Exit 1 if any worker is bound elsewhere. core-complex must be refused in one line (exit 2).

    python -m bench.placement.numa_check  # on the device, after `. bench/device_setup.sh`

Without CUDA (`--smoke` here) only the refusal is checked, and it says it skipped the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, smoke

FT = ROOT / ".venv" / "bin" / "ft_launcher"
# ft_launcher runs this module as the worker, from the repository root (its imports are bench.'s)
SELF = ("--module", "bench.placement.numa_check")


def worker(out: Path) -> None:
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_rank = int(os.environ["LOCAL_RANK"])
    with open("/proc/self/status") as status:
        mems = next(line.split()[1] for line in status if line.startswith("Mems_allowed_list"))
    record = {"cycle": cycle, "local_rank": local_rank, "mems": mems,
              "cpus": sorted(os.sched_getaffinity(0))}  # fmt: skip
    (out / f"c{cycle}-r{local_rank}.json").write_text(json.dumps(record))
    if cycle == 0 and local_rank == 0:
        sys.exit(1)  # once: the restart's workers come from the fork server


def expected(gpu: int, scope: str) -> tuple[set[int], set[int]]:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    words = (os.cpu_count() or 1) // 64 + 1
    code = pynvml.NVML_AFFINITY_SCOPE_NODE if scope == "node" else pynvml.NVML_AFFINITY_SCOPE_SOCKET
    cpus = pynvml.nvmlDeviceGetCpuAffinityWithinScope(handle, words, code)
    mems = pynvml.nvmlDeviceGetMemoryAffinity(handle, words, code)

    def bits(mask: list[int]) -> set[int]:
        return {i * 64 + b for i, w in enumerate(mask) for b in range(64) if int(w) >> b & 1}

    return bits(cpus) & os.sched_getaffinity(0), bits(mems)


def cpulist(items: set[int] | list[int]) -> str:
    from ftrun.agent.placement.binding import format_cpulist

    return format_cpulist(items)


def check_mode(mode: str, nproc: int) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        done = subprocess.run(
            [str(FT), "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=1",
             f"--numa-binding={mode}", f"--log-dir={out / 'logs'}", *SELF, "--worker",
             str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            print(f"{mode}: launcher exit {done.returncode}: {done.stderr.strip()[-800:]}")
            return False
        good = True
        for path in sorted(out.glob("c*-r*.json")):
            got = json.loads(path.read_text())
            cpus, mems = expected(got["local_rank"], "socket" if mode == "socket" else "node")
            inside = set(got["cpus"]) <= cpus and (not mems or got["mems"] == cpulist(mems))
            exact = mode == "exclusive" or set(got["cpus"]) == cpus
            good &= inside and exact
            print(f"{mode:<9} cycle {got['cycle']} local rank {got['local_rank']}: CPUs "
                  f"{cpulist(got['cpus'])} mems {got['mems']} | NVML {cpulist(cpus)} mems "
                  f"{cpulist(mems) or '-'} | {'OK' if inside and exact else 'WRONG'}")  # fmt: skip
        return good


def refused_in_one_line() -> bool:
    """core-complex: refused, exit 2, one line (no GPU needed: the check is the launcher's)."""
    refused = subprocess.run([str(FT), "--numa-binding=core-complex", *SELF], cwd=ROOT,
                             capture_output=True, text=True, check=False)  # fmt: skip
    print(f"core-complex: exit {refused.returncode}: {refused.stderr.strip()}")
    return refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--nproc-per-node", type=int, default=0, help="default: every GPU")
    args = smoke.parse_args(parser, {"nproc_per_node": 1})
    if args.worker:
        return worker(args.worker)
    import torch

    if not torch.cuda.is_available():
        smoke.skip_gpu("numa_check", "the bindings (no GPU whose NUMA node to check)")
        sys.exit(0 if refused_in_one_line() else 1)
    nproc = args.nproc_per_node or torch.cuda.device_count()
    print(f"{torch.cuda.get_device_name(0)} x{nproc}, {os.cpu_count()} CPUs, launcher may use "
          f"{cpulist(os.sched_getaffinity(0))}")  # fmt: skip
    good = all([check_mode(mode, nproc) for mode in ("node", "socket", "exclusive")])
    one_line = refused_in_one_line()
    sys.exit(0 if good and one_line else 1)


if __name__ == "__main__":
    main()
