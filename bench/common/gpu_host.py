"""What a GPU bench asks of the machine, from a child process (the bench itself holds no CUDA
context while its jobs run): is there a GPU, does NVRx import, and the line that names it."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys

PY = sys.executable


def nvrx_importable() -> bool:
    try:
        importlib.import_module("nvidia_resiliency_ext")
    except Exception:  # whatever it raises, NVRx cannot run here
        return False
    return True


def cuda_in_child() -> bool:
    """Whether torch sees a GPU, asked of a child: this process holds no CUDA context."""
    code = "import torch; print(torch.cuda.is_available())"
    said = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
    return said.stdout.strip() == "True"


def machine_line(device: str) -> str:
    """GPU (or CPU), cores, torch and NVRx versions; asked of a child, so that this process
    holds no CUDA context while the jobs run."""
    gpu = "torch.cuda.get_device_name()" if device == "cuda" else "'CPU'"
    code = f"import torch; print(torch.__version__); print({gpu})"
    said = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
    found = said.stdout.split("\n") if said.returncode == 0 else []
    torch_version, gpu = [*found, "?", "?"][:2]
    try:
        nvrx = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        nvrx = "not installed"
    return f"{gpu}; {os.cpu_count()} cores; torch {torch_version}; NVRx {nvrx}"
