"""The goodput model (docs/goodput.md): each setting's goodput at 1,024 and 16,384 GPUs, from
the lost seconds of each fault kind that `bench/goodput/goodput.py` measured, and the published
failure rates; checked against the bench at the bench's own size.

    goodput = (1 - stall) x (1 - sum over kinds k of p_k x lost_k / MTTF)

- MTTF, the job's mean time to failure: 7.9 h at 1,024 GPUs and 1.8 h at 16,384 (Meta's research
  clusters, arXiv 2410.21680); Llama 3 saw 419 interruptions in 54 days on 16,384 GPUs (3.1 h,
  arXiv 2407.21783).
- p_k, the mix of kinds, our reading of Llama 3's table of interruptions (78 % hardware): a lost
  node 0.78 (the hardware faults: the node is drained and replaced), an exception 0.15 (software
  bugs 12.9 %, dependencies 2.3 %), a hang 0.02 (NCCL watchdog timeouts 1.7 %), a killed rank
  0.05 (the rest).
- lost_k = detect + recover (measured) + steps redone (measured) x the step time at scale
  (`--step-s`, 5 s by default: an assumption). A setting without a spare cannot replace a lost
  node inside the job: its lost node costs the job's requeue (`--requeue-s`, 600 s: an
  assumption) plus its measured killed-rank cost.
- stall, the fraction of the wall the saves held the training, as measured.

At the bench's size the same formula takes MTTF = the bench's fault interval and p_k = the kinds
it fired; its prediction sits beside the measured goodput.

    python -m bench.goodput.model RESULTS.json [--step-s 5] [--requeue-s 600] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping
from pathlib import Path

from bench.common import smoke
from bench.common.report import table

MTTF_H = {1024: 7.9, 16384: 1.8}
MIX = {"node": 0.78, "raise": 0.15, "stop": 0.02, "kill": 0.05}


_FAULT = {"detect": 0.2, "recover": 0.5, "redone": 1}
SAMPLE = {  # `--smoke`: made-up figures of the shape goodput.py writes
    "step_s": 0.25, "every_s": 15, "duration_s": 60,
    "settings": {"a setting": {"goodput": [0.9], "stall_per_interval_s": [0.1], "faults": [
        {**_FAULT, "kind": kind} for kind in MIX]}},
}  # fmt: skip


def kind_costs(faults: list[dict], step_s: float) -> dict[str, float]:
    """Median lost seconds per fault kind: detect + recover + redone x `step_s`."""
    costs = {}
    for kind in MIX:
        lost = [f["detect"] + f["recover"] + f["redone"] * step_s
                for f in faults if f["kind"] == kind and f["detect"] is not None]  # fmt: skip
        if lost:
            costs[kind] = statistics.median(lost)
    return costs


def predicted(costs: Mapping[str, float], mix: Mapping[str, float], mttf_s: float,
              stall: float) -> float:  # fmt: skip
    lost = sum(share * costs.get(kind, 0.0) for kind, share in mix.items())
    return max(0.0, (1 - stall) * (1 - lost / mttf_s))


def at_scale(setting: dict, args: argparse.Namespace) -> tuple[dict[str, float], float]:
    """(lost seconds per kind at scale, stall fraction) for one setting's measurements."""
    costs = kind_costs(setting["faults"], args.step_s)
    if "node" not in costs and "kill" in costs:  # no spare: the job is requeued
        costs["node"] = args.requeue_s + costs["kill"]
    stall = statistics.median(setting["stall_per_interval_s"]) / args.every_s
    return costs, stall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", help="goodput.py --json's file")
    parser.add_argument("--step-s", type=float, default=5.0)
    parser.add_argument("--requeue-s", type=float, default=600.0)
    parser.add_argument("--markdown", action="store_true")
    args = smoke.parse_args(parser, {})
    if args.results is None and not args.smoke:
        parser.error("give the results of bench/goodput/goodput.py --json")
    data = SAMPLE if args.smoke else json.loads(args.results.read_text())
    args.every_s = data["every_s"]
    rows = []
    for name, setting in data["settings"].items():
        costs, stall = at_scale(setting, args)
        fired = [f["kind"] for f in setting["faults"] if f["detect"] is not None]
        bench_mix = {k: fired.count(k) / len(fired) for k in MIX} if fired else MIX
        here = predicted(kind_costs(setting["faults"], data["step_s"]), bench_mix,
                         data["every_s"], stall)  # fmt: skip
        measured = statistics.median(setting["goodput"])
        scale = [predicted(costs, MIX, MTTF_H[n] * 3600, stall) for n in MTTF_H]
        cells = " / ".join(f"{k} {costs[k]:.0f}" for k in MIX if k in costs)
        rows.append([name, cells, f"{stall * 100:.1f} %", f"{measured:.3f}", f"{here:.3f}",
                     *(f"{g:.4f}" for g in scale)])  # fmt: skip
    headers = ["setting", "lost s per fault at scale (node / raise / stop / kill)", "stall",
               "bench: measured", "bench: model", "1,024 GPUs", "16,384 GPUs"]  # fmt: skip
    print(table(headers, rows, args.markdown))
    print(f"step time at scale {args.step_s:g} s, a requeue {args.requeue_s:g} s (assumptions); "
          f"MTTF {MTTF_H[1024]} h and {MTTF_H[16384]} h (arXiv 2410.21680)")  # fmt: skip


if __name__ == "__main__":
    main()
