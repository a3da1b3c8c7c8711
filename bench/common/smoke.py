"""`--smoke`: every bench's seconds-long size, its real code path at the smallest size it has
(tests/test_bench_smoke.py runs each in `make test`, so a change that breaks a bench fails
there, not months later on the device). Its figures mean nothing; its table header says the
code ran. A GPU bench without CUDA runs what it can (imports, arguments, a CPU path) and says
in one line that it skipped the rest (`skip_gpu`), exiting 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

HELP = "a tiny size, seconds on a 2-core machine (its figures mean nothing): a check that it runs"


def parse_args(
    parser: argparse.ArgumentParser, sizes: Mapping[str, Any], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """`parser`'s arguments plus `--smoke`, which puts `sizes` (dest -> value) in place of
    what the size flags gave."""
    parser.add_argument("--smoke", action="store_true", help=HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(sizes)
    return args


def skip_gpu(bench: str, what: str = "its GPU part") -> None:
    """The one line a GPU bench prints where there is no CUDA (the smoke test looks for it)."""
    print(f"{bench}: no CUDA here: skipped {what}", flush=True)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
