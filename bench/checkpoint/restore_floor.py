"""The floor under a verified restore from node memory: what reading a part's bytes out of
/dev/shm into a model's tensors and checking them costs this machine, before any ftrun code.

bench/checkpoint/checkpoint.py's restore target is <= 1.5x a memcpy into the model. This bench
takes the format away (one flat tensor of `--sizes-mib`, random bytes, in a /dev/shm file) and
measures the ways to get those bytes into a preallocated, touched tensor, each beside the memcpy
of the same bytes in the same run (`dst.copy_(src)`, torch's intra-op threads):

- preadv: the file read with `os.preadv` into the tensor in `--chunk-kib` chunks, split in two
  halves over 2 threads (the kernel copies; tmpfs looks every page up);
- preadv + CRC-32C: the same, each chunk's CRC-32C computed while it is in cache (what
  `load(into=...)` does);
- CRC-32C alone, 2 threads, of bytes already in memory;
- mmap + copy: the file mapped read-only (each page faulted in on first touch), then `copy_`;
- mmap with MAP_POPULATE: the mapping alone, its page tables filled up front.

Ratios are run by run to that run's memcpy; medians of `--runs`. Seconds are wall time.

    python -m bench.checkpoint.restore_floor [--sizes-mib 1024 4096] [--runs 5] [--smoke]
        [--chunk-kib 1024]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import torch

from bench.common import smoke, timing

THREADS = 2


def halves(nbytes: int) -> list[tuple[int, int]]:
    return [(i * nbytes // THREADS, (i + 1) * nbytes // THREADS) for i in range(THREADS)]


def in_threads(work: Callable[[int, int], object], nbytes: int) -> None:
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda span: work(*span), halves(nbytes)))


def preadv_into(path: Path, dst: torch.Tensor, chunk: int, check: bool) -> None:
    view = memoryview(dst.numpy())
    fd = os.open(path, os.O_RDONLY)

    def read(lo: int, hi: int) -> int:
        crc = 0
        for offset in range(lo, hi, chunk):
            piece = view[offset : min(offset + chunk, hi)]
            os.preadv(fd, [piece], offset)
            if check:
                crc = crc32c.crc32c(piece, crc)
        return crc

    try:
        in_threads(read, dst.numel())
    finally:
        os.close(fd)


def crc_only(src: torch.Tensor) -> None:
    view = memoryview(src.numpy())
    in_threads(lambda lo, hi: crc32c.crc32c(view[lo:hi]), src.numel())


def mapped_copy(path: Path, dst: torch.Tensor, populate: bool) -> None:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, dst.numel(), flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if not populate:
        with warnings.catch_warnings():  # a read-only buffer: only read here
            warnings.simplefilter("ignore")
            dst.copy_(torch.frombuffer(mapping, dtype=torch.uint8))
    mapping.close()


def measure(nbytes: int, runs: int, chunk: int) -> dict[str, list[float]]:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ftrun-floor-") as directory:
        path = Path(directory) / "part"
        with path.open("wb") as f:
            f.write(memoryview(src.numpy()))
        cases: dict[str, Callable[[], object]] = {
            "memcpy": lambda: dst.copy_(src),
            "preadv": lambda: preadv_into(path, dst, chunk, check=False),
            "preadv + CRC-32C": lambda: preadv_into(path, dst, chunk, check=True),
            "CRC-32C alone": lambda: crc_only(src),
            "mmap + copy (page faults)": lambda: mapped_copy(path, dst, populate=False),
            "mmap, MAP_POPULATE (no copy)": lambda: mapped_copy(path, dst, populate=True),
        }
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(runs + 1):  # the first run warms up and is dropped
            for name, work in cases.items():
                seconds[name].append(timing.seconds(work))
        if not torch.equal(src, dst):
            raise AssertionError("the bytes read differ from the bytes written")
    return {name: values[1:] for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--chunk-kib", type=int, default=1024)
    args = smoke.parse_args(parser, {"sizes_mib": [4], "runs": 1})
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads, {args.runs} runs")  # fmt: skip
    print("| measurement | " + " | ".join(f"{m} MiB: s | x memcpy" for m in args.sizes_mib) + " |")
    print("|---" * (1 + 2 * len(args.sizes_mib)) + "|")
    results = [measure(mib << 20, args.runs, args.chunk_kib << 10) for mib in args.sizes_mib]
    for name in results[0]:
        cells = []
        for result in results:
            ratios = [s / m for s, m in zip(result[name], result["memcpy"], strict=True)]
            cells += [f"{statistics.median(result[name]):.3f}", f"{statistics.median(ratios):.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
