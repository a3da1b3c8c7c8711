"""The one place `pynvml` (from nvidia-ml-py) is loaded: lazily, since most dev machines have no
GPU, and at one boundary that tests replace with a fake module (tests/fakes/pynvml.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def load_nvml() -> Any:
    """The initialised `pynvml` module, or None without NVML (no driver, no GPUs)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


@contextlib.contextmanager
def nvml_session() -> Iterator[Any]:
    """`with nvml_session() as nvml:` the module (None without NVML), shut down at the end."""
    nvml = load_nvml()
    try:
        yield nvml
    finally:
        if nvml is not None:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
