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
    """Whether torch sees a GPU, asked of a child: this process holds no CUDA context. A bench
    that imported torch already asks a forked child (no second interpreter importing torch)."""
    if "torch" not in sys.modules:
        code = "import torch; print(torch.cuda.is_available())"
        said = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
        return said.stdout.strip() == "True"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer on the pipe, leave without the parent's exit handlers
        os.close(read)
        try:
            os.write(write, b"1" if sys.modules["torch"].cuda.is_available() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        said = answer.read()
    os.waitpid(pid, 0)
    return said == b"1"


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
