"""NVRx 0.7's own examples under ftrun with only their import lines changed (issue 25's acceptance).

    python -m bench.compat.nvrx_examples --examples <NVRx checkout>/examples --set cpu
        [--json out.json] [--smoke]

The examples are NVRx's, not ours: pass the `examples/` folder of a checkout of
NVIDIA/nvidia-resiliency-ext (nothing of it is kept in this repository; `.nvrx/` is git-ignored
for a copy that travels to the device). They are copied to a fresh directory, and `IMPORTS` rewrites
their import lines, the mapping the README's "Migrating from NVRx" gives. The CPU variant of
`checkpointing/local_ckpt.py` also has its device lines changed (`DEVICE_LINES`). Each case then
runs as NVRx's docs run it, under `ft_launcher` (or, for the straggler example, by itself: it
starts its own `torch.distributed.launcher`), in its own working directory; a resumed run is a
second run in the same directory, which finds the first run's state.

Sets:
- `cpu`: the fault-tolerance examples (`--device=cpu`, NVRx's YAMLs), each fresh and resumed;
  `local_ckpt.py` (CPU variant) in its four flag combinations, replication across two launchers
  of 4 ranks each (NVRx's defaults: jump 4, factor 2). `--skip-basic` leaves out
  `basic_ft_example.py` (10 epochs of a 4096-wide MLP: half an hour on 2 cores).
- `cuda`: `local_ckpt.py`, `async_ckpt.py` and `async_writer.py` (FSDP, the two-phase DCP save)
  as NVRx ships them, and `straggler/example.py` with
  a local MNIST-shaped dataset (`data/MNIST/raw`, written here: the device has no network).
  Replicated local checkpoints need a GPU per rank (NCCL refuses two ranks on one device):
  with fewer than 2 GPUs those two combinations are skipped, and said so.

One row per run: case, run, exit code, seconds; exit status 1 if any run failed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, smoke
from bench.common.jobs import free_port
from bench.common.timing import Stopwatch

IMPORTS = (
    (r"^import nvidia_resiliency_ext\.fault_tolerance as", "import ftrun.client_lib as"),
    (
        r"^from nvidia_resiliency_ext\.checkpointing(\.[\w.]+)? import",
        "from ftrun.checkpointing import",
    ),
    (r"^from nvidia_resiliency_ext\.attribution import straggler", "from ftrun import straggler"),
    (
        r"^from nvidia_resiliency_ext\.ptl_resiliency(\.[\w.]+)? import",
        "from ftrun.lightning import",
    ),
)
DEVICE_LINES = (  # local_ckpt.py on CPU: gloo, no set_device, the model on the CPU
    ('init_distributed_backend(backend="nccl")', 'init_distributed_backend(backend="gloo")'),
    ("        torch.cuda.set_device(dist.get_node_local_rank())\n", ""),
    ('model = SimpleModel().to("cuda")', 'model = SimpleModel().to("cpu")'),
)
ONLY = ""  # --only
FOLDERS = ("fault_tolerance", "checkpointing", "straggler")
SMALL = ["--hidden", "256", "--train_dataset_size", "4000", "--logging_interval", "100"]
LOCAL_CKPT_FLAGS = {
    "sync": [],
    "async": ["--async_save"],
    "sync+replication": ["--replication"],
    "async+replication": ["--async_save", "--replication"],
}


def rewrite(text: str, extra: tuple[tuple[str, str], ...] = ()) -> str:
    for pattern, replacement in IMPORTS:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    for old, new in extra:
        if old not in text:
            raise SystemExit(f"nvrx_examples: the example changed: {old!r} not found")
        text = text.replace(old, new)
    if "nvidia_resiliency_ext" in re.sub(r"#.*", "", text):
        raise SystemExit("nvrx_examples: an import of nvidia_resiliency_ext is left unmapped")
    return text


def prepare(examples: Path, work: Path) -> Path:
    """Copy the examples into `work` with their imports rewritten; the copy's root."""
    root = work / "examples"
    for folder in FOLDERS:
        shutil.copytree(examples / folder, root / folder)
        for path in (root / folder).glob("*.py"):
            path.write_text(rewrite(path.read_text()))
    local = root / "checkpointing" / "local_ckpt.py"
    original = (examples / "checkpointing" / "local_ckpt.py").read_text()
    (local.parent / "local_ckpt_cpu.py").write_text(rewrite(original, DEVICE_LINES))
    return root


def launchers(nodes: int, nproc: int, argv: list[str]) -> list[list[str]]:
    endpoint = f"127.0.0.1:{free_port()}"
    common = [f"--nnodes={nodes}", f"--nproc-per-node={nproc}"]
    if nodes > 1:
        common += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=nvrx-ex"]
    launcher = [sys.executable, "-m", "ftrun.ft_launcher.cli"]
    return [[*launcher, *common, *argv] for _ in range(nodes)]


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def run(
    name: str,
    commands: list[list[str]],
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    gpus: list[str] | None = None,
) -> dict[str, object] | None:
    if ONLY and not re.search(ONLY, name):
        return None
    cwd.mkdir(parents=True, exist_ok=True)
    started = Stopwatch()
    procs = []
    for index, command in enumerate(commands):
        node_env = dict(env)
        if gpus is not None:
            node_env["CUDA_VISIBLE_DEVICES"] = gpus[index]
        log = (cwd / f"{slug(name)}.node{index}.log").open("ab")
        procs.append(
            subprocess.Popen(
                command,
                cwd=cwd,
                env=node_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, timeout - started.seconds())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            codes.append(proc.wait())
    seconds = round(started.seconds(), 1)
    rc = next((c for c in codes if c != 0), 0)
    print(f"{name:<40} rc={rc:<4} {seconds:>7.1f} s  ({cwd})", flush=True)
    return {"case": name, "rc": rc, "seconds": seconds, "dir": str(cwd)}


def cpu_cases(root: Path, work: Path, env: dict[str, str], skip_basic: bool) -> list[dict | None]:
    ft = root / "fault_tolerance"
    rows = []
    if not skip_basic:
        argv = [
            f"--ft-cfg-path={ft / 'fault_tol_cfg_heartbeats.yaml'}",
            str(ft / "basic_ft_example.py"),
        ]
        for run_name in ("fresh", "resumed"):
            rows.append(
                run(
                    f"basic_ft_example {run_name}", launchers(1, 2, argv), work / "basic", env, 1800
                )
            )
    for api in ("heartbeats", "sections"):
        script, cfg = ft / f"train_ddp_{api}_api.py", ft / f"fault_tol_cfg_{api}.yaml"
        out = work / api / "results"
        for run_name, epochs in (("fresh", "2"), ("resumed", "3")):
            argv = [
                f"--ft-cfg-path={cfg}",
                str(script),
                "--device=cpu",
                *SMALL,
                "--epochs",
                epochs,
                "--output_dir",
                str(out),
            ]
            rows.append(
                run(f"train_ddp_{api}_api {run_name}", launchers(1, 2, argv), work / api, env, 600)
            )
    rows += simulated_fault_cases(ft, work, env)
    script = root / "checkpointing" / "local_ckpt_cpu.py"
    for flags_name, flags in LOCAL_CKPT_FLAGS.items():
        argv = [str(script), "--ckpt_dir", str(work / "lc" / flags_name / "ckpt"), *flags]
        nodes, nproc = (2, 4) if "replication" in flags_name else (1, 2)
        rows.append(
            run(
                f"local_ckpt (cpu) {flags_name}",
                launchers(nodes, nproc, argv),
                work / "lc" / flags_name,
                env,
                300,
            )
        )
    return rows


def simulated_fault_cases(ft: Path, work: Path, env: dict[str, str]) -> list[dict | None]:
    """NVRx's own fault test: `--simulated_fault=rank_killed|rank_hung,DELAY` (SIGKILL or
    SIGSTOP of a random rank once the heartbeat timeouts are calculated), 2 ranks, resumed from
    the example's checkpoint after each restart. Each new cycle arms the fault again, so the
    run ends once an epoch outruns it (or the restart budget is spent: then rc 1)."""
    rows = []
    cfg = ft / "fault_tol_cfg_heartbeats.yaml"
    for fault in ("rank_killed", "rank_hung"):
        out = work / fault / "results"
        argv = [
            f"--ft-cfg-path={cfg}",
            "--max-restarts=6",
            f"--log-dir={work / fault / 'logs'}",
            str(ft / "train_ddp_heartbeats_api.py"),
            "--device=cpu",
            *SMALL,
            "--epochs",
            "4",
            "--save_interval",
            "50",
            "--output_dir",
            str(out),
            "--simulated_fault",
            f"{fault},1",
        ]
        rows.append(
            run(f"train_ddp_heartbeats_api {fault}", launchers(1, 2, argv), work / fault, env, 600)
        )
    return rows


def cuda_cases(root: Path, work: Path, env: dict[str, str], gpus: int) -> list[dict | None]:
    rows = []
    script = root / "checkpointing" / "local_ckpt.py"
    for flags_name, flags in LOCAL_CKPT_FLAGS.items():
        argv = [str(script), "--ckpt_dir", str(work / "lc" / flags_name / "ckpt"), *flags]
        if "replication" in flags_name:
            if gpus < 2:
                print(f"local_ckpt {flags_name}: skipped, one GPU (a GPU per rank needed)")
                continue
            argv += ["--replication_jump", "1", "--replication_factor", "2"]
            rows.append(
                run(
                    f"local_ckpt {flags_name}",
                    launchers(2, 1, argv),
                    work / "lc" / flags_name,
                    env,
                    300,
                    ["0", "1"],
                )
            )
        else:
            rows.append(
                run(
                    f"local_ckpt {flags_name}",
                    launchers(1, gpus, argv),
                    work / "lc" / flags_name,
                    env,
                    300,
                )
            )
    script = root / "checkpointing" / "async_ckpt.py"
    for name, flags in (("persistent", []), ("no_persistent_queue", ["--no_persistent_queue"])):
        argv = [str(script), "--ckpt_dir", str(work / "async" / name / "ckpt"), *flags]
        rows.append(
            run(f"async_ckpt {name}", launchers(1, gpus, argv), work / "async" / name, env, 300)
        )
    script = root / "checkpointing" / "async_writer.py"
    argv = [str(script), "--ckpt_dir", str(work / "writer" / "ckpt")]
    rows.append(run("async_writer", launchers(1, gpus, argv), work / "writer", env, 300))
    straggler_dir = work / "straggler"
    write_fake_mnist(straggler_dir / "data" / "MNIST" / "raw")
    command = [
        sys.executable,
        str(root / "straggler" / "example.py"),
        "--num-processes",
        str(gpus),
        "--num-epochs",
        "1",
    ]
    rows.append(run("straggler/example.py", [command], straggler_dir, env, 600))
    return rows


def write_fake_mnist(raw: Path, train: int = 6000, test: int = 1000) -> None:
    """MNIST's four idx files (random pixels) where torchvision looks before downloading."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = __import__("random").Random(0)
    for prefix, count in (("train", train), ("t10k", test)):
        images = struct.pack(">IIII", 2051, count, 28, 28) + rng.randbytes(count * 784)
        labels = struct.pack(">II", 2049, count) + bytes(rng.randrange(10) for _ in range(count))
        for suffix, data in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            (raw / f"{prefix}-{suffix}").write_bytes(data)
            with gzip.open(raw / f"{prefix}-{suffix}.gz", "wb") as f:
                f.write(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=Path, default=ROOT / ".nvrx" / "examples",
                        help="NVRx's examples/ folder (default .nvrx/examples)")  # fmt: skip
    parser.add_argument("--set", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--work", type=Path, help="where the runs happen (default: a temp dir)")
    parser.add_argument("--skip-basic", action="store_true", help="leave out basic_ft_example")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="OMP_NUM_THREADS of each worker (ft_launcher's default is 1)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--only", default="", help="run only the cases this regex matches")
    parser.add_argument("--logs", type=Path, help="copy every run's log here, flat")
    # the smoke: one case, the first run of the heartbeats API example
    sizes = {"skip_basic": True, "only": "^train_ddp_heartbeats_api fresh$", "gpus": 1}
    args = smoke.parse_args(parser, sizes)
    global ONLY
    ONLY = args.only
    if args.smoke and not args.examples.is_dir():
        print(f"nvrx_examples: no NVRx examples at {args.examples}: skipped every case")
        return 0
    if not all((args.examples / folder).is_dir() for folder in FOLDERS):
        parser.error(f"{args.examples} lacks one of {', '.join(FOLDERS)}: not NVRx's examples/")
    work = args.work or Path(tempfile.mkdtemp(prefix="nvrx-examples-"))
    root = prepare(args.examples, work)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.omp_threads), "PYTHONUNBUFFERED": "1"}
    if args.set == "cpu":
        rows = cpu_cases(root, work, env, args.skip_basic)
    else:
        rows = cuda_cases(root, work, env, args.gpus)
    rows = [row for row in rows if row is not None]
    failed = [r["case"] for r in rows if r["rc"] != 0]
    print(
        f"{len(rows) - len(failed)} of {len(rows)} passed"
        + (f"; failed: {failed}" if failed else "")
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        for log in work.rglob("*.node*.log"):
            shutil.copy(log, args.logs / log.name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
