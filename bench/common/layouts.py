"""Where a GPU bench job's ranks run: one launcher with N GPUs (`"4"`), or several launchers on
one host as several nodes (`"2x2"`: 2 launchers x 2 GPUs), each with its own GPUs
(`CUDA_VISIBLE_DEVICES`) and NCCL between them, rendezvousing over c10d on 127.0.0.1: the same
flags for ft_launcher, torchrun and NVRx's launcher."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

MAX_RESTARTS = "--max-restarts=3"


@dataclasses.dataclass(frozen=True)
class Layout:
    nodes: int
    gpus: int
    """Per node (launcher)."""

    @classmethod
    def parse(cls, text: str) -> Layout:
        """`"N"` (one launcher, N GPUs) or `"AxB"` (A launchers, B GPUs each)."""
        match = re.fullmatch(r"(?:(\d+)x)?(\d+)", text.strip())
        if match is None or int(match[2]) < 1 or (match[1] is not None and int(match[1]) < 1):
            raise ValueError(f"not a layout: {text!r} (N GPUs, or AxB: A launchers x B GPUs)")
        return cls(int(match[1] or 1), int(match[2]))

    @property
    def name(self) -> str:
        return str(self.gpus) if self.nodes == 1 else f"{self.nodes}x{self.gpus}"

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    def launcher_args(self, port: int, run_id: str) -> list[str]:
        if self.nodes == 1:
            return ["--standalone", f"--nproc-per-node={self.gpus}", MAX_RESTARTS]
        return [f"--nnodes={self.nodes}", f"--nproc-per-node={self.gpus}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={run_id}", MAX_RESTARTS]  # fmt: skip

    def node_env(self, node: int, device: str, environ: Mapping[str, str]) -> dict[str, str]:
        """Launcher `node`'s own GPUs, out of those visible to the bench (none for the CPU, or
        for one launcher: its ranks take GPUs 0..N-1 by local rank, as under torchrun)."""
        if device != "cuda" or self.nodes == 1:
            return {}
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(self.world)]
        mine = ids[node * self.gpus : (node + 1) * self.gpus]
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def layouts_for(gpus: int) -> list[str]:
    """The layouts a host with `gpus` GPUs runs: 1 GPU, and where there are enough, 2 and 4 on one
    launcher and two launchers of half the GPUs each (`make bench-gpu`)."""
    chosen = ["1"]
    chosen += [str(n) for n in (2, 4) if n <= gpus]
    chosen += [f"2x{n // 2}" for n in (min(gpus, 4),) if n >= 2]
    return chosen


def main() -> None:
    """Print the layouts for the GPUs torch sees here, comma-separated (a child asks torch, so
    that the caller holds no CUDA context)."""
    import subprocess
    import sys

    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    print(",".join(layouts_for(int(said.stdout.strip() or 0))))


if __name__ == "__main__":
    main()
