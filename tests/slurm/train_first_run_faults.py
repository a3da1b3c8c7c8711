"""examples/train_ddp.py whose fault flags apply only in the first run of a relaunched job.

The example fires `--crash CYCLE:RANK:STEP` (and `--hang`, `--hang-collective`) in the given
in-job cycle, and cycle numbers start again at 0 in every relaunched Slurm job: "crash once"
would crash every relaunch as well. slurm/ftrun.sbatch tells runs apart with FTRUN_JOB_RUN
(0 in the first run); from the second run on, this wrapper drops the fault flags.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
FAULT_FLAGS = frozenset({"--crash", "--hang", "--hang-collective"})


def without_faults(args: list[str]) -> list[str]:
    """`args` minus every `--flag VALUE` / `--flag=VALUE` pair of FAULT_FLAGS."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
        elif arg in FAULT_FLAGS:
            skip_value = True
        elif arg.split("=", 1)[0] not in FAULT_FLAGS:
            kept.append(arg)
    return kept


def main() -> None:
    args = sys.argv[1:]
    if os.environ.get("FTRUN_JOB_RUN", "0") != "0":
        args = without_faults(args)
    sys.argv = [str(EXAMPLE), *args]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
