"""The checkpoint benches' state (a mixed-precision model + Adam state of an exact size, as
bench/checkpoint/checkpoint.py's docstring describes it) and "the model" it restores into; the
directories they create, removed whatever happens; the disk they write to (their timer is
`timing`'s)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

MIB = 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


# ---- the state -----------------------------------------------------------------------------


def _matrix(numel: int, cols: int = 1024) -> tuple[int, int]:
    return max(1, numel // cols), cols


def matrix_shares(layers: int) -> dict[str, float]:
    """Each weight matrix's share of the parameters: an embedding and `layers` blocks."""
    shares = {"embed.weight": 0.12}
    per_layer = {"attn.qkv.weight": 3, "attn.proj.weight": 1, "mlp.fc1.weight": 4}
    per_layer["mlp.fc2.weight"] = 4
    unit = (1 - shares["embed.weight"]) / (layers * sum(per_layer.values()))
    for i in range(layers):
        for name, weight in per_layer.items():
            shares[f"layers.{i}.{name}"] = weight * unit
    return shares


def vector_names(layers: int) -> list[str]:
    """Small vectors of 1024, as real models have many of them."""
    return [
        f"layers.{i}.{name}"
        for i in range(layers)
        for name in ("norm1.weight", "norm2.weight", "mlp.fc1.bias")
    ]


def build_state(nbytes: int) -> dict[str, Any]:
    """A model + optimizer state of exactly `nbytes` tensor bytes (checkpoint.py describes it)."""
    layers = 8 if nbytes >= 256 * MIB else 2
    # Per parameter: bf16 weight (2) + fp32 master, exp_avg, exp_avg_sq (12) bytes.
    params_total = nbytes // 14
    shares = matrix_shares(layers)
    shapes = {name: _matrix(int(params_total * share * 0.98)) for name, share in shares.items()}
    shapes.update(dict.fromkeys(vector_names(layers), (1024,)))
    model = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    master = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    moments = {
        name: {
            "step": torch.tensor(1000.0),
            "exp_avg": torch.empty(shape, dtype=torch.float32),
            "exp_avg_sq": torch.empty(shape, dtype=torch.float32),
        }
        for name, shape in shapes.items()
    }
    state: dict[str, Any] = {
        "model": model,
        "master_params": master,
        "optimizer": {
            "state": moments,
            "param_groups": [
                {
                    "lr": 3e-4,
                    "betas": (0.9, 0.95),
                    "eps": 1e-8,
                    "weight_decay": 0.1,
                    "params": list(shapes),
                }
            ],
        },
        "iteration": 1000,
        "loss_scale": 65536.0,
        "config": {"model": "bench-llm", "layers": layers, "seq_len": 4096},
    }
    rest = nbytes - tensor_bytes(state)
    if rest < 0 or rest % 2:
        raise ValueError(f"cannot shape a state of {nbytes} bytes (left: {rest})")
    state["model"]["rope.cache"] = torch.empty(rest // 2, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(nbytes)
    for tensor in tensors_of(state):
        tensor.uniform_(-1.0, 1.0, generator=generator)
    return state


def tensors_of(state: Any) -> Iterator[torch.Tensor]:
    """The state's tensors in traversal order (dict order), the same for a loaded copy."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors_of(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from tensors_of(value)


def tensor_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def like(state: Any) -> list[torch.Tensor]:
    """The model: tensors like the state's, allocated and touched once."""
    return [torch.zeros_like(t) for t in tensors_of(state)]


def copy_into(model: list[torch.Tensor], state: Any) -> None:
    for dst, src in zip(model, tensors_of(state), strict=True):
        dst.copy_(src)


def shaped_as(state: Any, model: list[torch.Tensor]) -> Any:
    """The state's structure holding the model's tensors (what `load(into=...)` fills)."""
    tensors = iter(model)

    def node(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return next(tensors)
        if isinstance(value, dict):
            return {k: node(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(node(v) for v in value)
        return value

    return node(state)


def same(model: list[torch.Tensor], state: Any, what: str) -> None:
    if not all(torch.equal(a, b) for a, b in zip(model, tensors_of(state), strict=True)):
        raise AssertionError(f"{what}: the restored model differs from the state")


# ---- what the bench creates, removed whatever happens ------------------------------------------


class Scratch:
    """Directories the bench made; `remove` each when done with it, `close` removes the rest."""

    def __init__(self, disk: Path) -> None:
        self.disk = disk
        self.dirs: list[Path] = []

    def mkdtemp(self, where: Path, prefix: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=where))  # mode 0700
        self.dirs.append(path)
        return path

    def remove(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)
        self.dirs.remove(path)

    def close(self) -> None:
        for path in reversed(self.dirs):
            shutil.rmtree(path, ignore_errors=True)
        self.dirs.clear()


def fixed_malloc_threshold() -> bool:
    """Make every allocation of 128 KiB or more a fresh mmap (and every free an munmap).

    glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after
    which blocks of that size come from the heap and are reused without page faults: a
    "fresh" allocation in run 2 would be warm memory from run 1. Fixing the threshold keeps
    every run alike."""
    with contextlib.suppress(OSError, AttributeError):
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024))
    return False


# ---- the disk -----------------------------------------------------------------------------------


def torch_save_fsync(state: Any, path: Path) -> None:
    """`torch.save` to `path`, flushed and fsynced: what a durable checkpoint costs."""
    with path.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def default_disk_dir() -> Path:
    """A temp directory on a real disk: the system's, unless that is a tmpfs."""
    for candidate in (Path(tempfile.gettempdir()), Path("/var/tmp")):
        if candidate.is_dir() and filesystem_type(candidate) not in {"tmpfs", "ramfs"}:
            return candidate
    return Path(tempfile.gettempdir())


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` is on (the longest mount point above it)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, part.fstype
    return kind
