"""What torchrun's worker-side options do: --virtual-local-rank and --duplicate-*-filters."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from ftrun.agent import workers
from ftrun.agent.output import FilteredCopy, filtered_log, matches
from ftrun.agent.placement.rank_env import rank_variables, visible_device

# --- --virtual-local-rank --------------------------------------------------------------------


def test_rank_variables_without_virtual_local_rank_keep_the_gpus() -> None:
    assert rank_variables(3, 11, False, "4,5,6,7") == {
        "LOCAL_RANK": "3",
        "RANK": "11",
        "ROLE_RANK": "11",
    }


@pytest.mark.parametrize(
    ("local_rank", "parent", "device"),
    [
        (2, None, "2"),  # no CUDA_VISIBLE_DEVICES: the local rank itself
        (1, "4,5,6", "5"),  # entry LOCAL_RANK of the launcher's list
        (1, "GPU-aa, GPU-bb", "GPU-bb"),  # UUIDs too, stripped as torch strips them
        (0, "", ""),  # torch's split: "" is one (empty) entry
    ],
)
def test_virtual_local_rank_gives_each_worker_one_gpu_at_index_0(
    local_rank: int, parent: str | None, device: str
) -> None:
    assert rank_variables(local_rank, 8 + local_rank, True, parent) == {
        "LOCAL_RANK": "0",
        "RANK": str(8 + local_rank),
        "ROLE_RANK": str(8 + local_rank),
        "CUDA_VISIBLE_DEVICES": device,
    }


def test_virtual_local_rank_without_a_gpu_for_the_rank_is_an_error() -> None:
    with pytest.raises(ValueError, match="local rank 2 has no GPU in CUDA_VISIBLE_DEVICES=0,1"):
        visible_device(2, "0,1")


@pytest.mark.parametrize("parent", [None, "3,1,2"])
@pytest.mark.parametrize("virtual", [False, True])
def test_same_as_torchruns_agent(
    monkeypatch: pytest.MonkeyPatch, parent: str | None, virtual: bool
) -> None:
    """torch 2.13's own `LocalElasticAgent._set_local_rank_env`, on the same inputs."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if parent is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    for local_rank in range(3):
        theirs: dict[str, str | None] = {"RANK": "5", "ROLE_RANK": "5"}
        spec = SimpleNamespace(virtual_local_rank=virtual)
        LocalElasticAgent._set_local_rank_env(None, theirs, local_rank, spec)  # type: ignore[arg-type]
        ours: dict[str, str | None] = {**rank_variables(local_rank, 5, virtual, parent)}
        if parent is not None and not virtual:
            ours["CUDA_VISIBLE_DEVICES"] = parent  # torchrun copies it; ftrun workers inherit it
        assert ours == theirs


# --- --duplicate-stdout-filters / --duplicate-stderr-filters ---------------------------------


def test_matching_is_torchruns_substring_rule() -> None:
    assert matches(b"step 3 loss=1.0\n", (b"acc", b"loss"))
    assert not matches(b"step 3\n", (b"acc", b"loss"))
    assert matches(b"anything\n", (b"",))  # an empty filter matches every line
    assert not matches(b"x\n", ())


def test_filtered_copy_appends_matching_lines_with_the_prefix(tmp_path: Path) -> None:
    path = filtered_log(tmp_path, "stdout")
    assert path == tmp_path / "filtered_stdout.log"
    with FilteredCopy(path, ("loss", "a,b"), b"[w0]:") as copy:
        for line in (b"loss 1\n", b"other\n", b"x a,b y\n", b"no newline loss"):
            copy.feed(line)
    with FilteredCopy(path, ("loss",), b"[w1]:") as copy:
        copy.feed("loss \u00e9\n".encode())
    assert path.read_bytes() == (
        b"[w0]:loss 1\n[w0]:x a,b y\n[w0]:no newline loss\n" + "[w1]:loss \u00e9\n".encode()
    )


def test_filtered_copy_without_filters_or_path_opens_nothing(tmp_path: Path) -> None:
    path = tmp_path / "f.log"
    with FilteredCopy(path, (), b"p") as copy:
        copy.feed(b"line\n")
    with FilteredCopy(None, ("line",), b"p") as copy:
        copy.feed(b"line\n")
    assert not path.exists()


def test_filtered_copy_stops_quietly_on_a_write_error(tmp_path: Path) -> None:
    with FilteredCopy(tmp_path / "f.log", ("x",), b"") as copy:
        assert copy._fd is not None
        read_only = os.open(os.devnull, os.O_RDONLY)
        os.dup2(read_only, copy._fd)  # writes now fail, as on a full or vanished disk
        os.close(read_only)
        copy.feed(b"x\n")
        copy.feed(b"x\n")
    assert copy._fd is None


class _Console:
    def __init__(self) -> None:
        self.buffer = io.BytesIO()


def test_pump_writes_log_console_and_filtered_copy(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"loss 1\nhello\nacc 2\n")
    os.close(write_fd)
    console = _Console()
    filtered = tmp_path / "filtered_stdout.log"
    workers._pump(
        os.fdopen(read_fd, "rb"),
        tmp_path / "stdout.log",
        console,  # type: ignore[arg-type]
        True,
        b"[r0]:",
        ("loss", "acc"),
        filtered,
    )
    assert (tmp_path / "stdout.log").read_bytes() == b"loss 1\nhello\nacc 2\n"
    assert console.buffer.getvalue() == b"[r0]:loss 1\n[r0]:hello\n[r0]:acc 2\n"
    assert filtered.read_bytes() == b"[r0]:loss 1\n[r0]:acc 2\n"


def test_workers_share_one_filtered_file_per_stream_and_cycle(tmp_path: Path) -> None:
    """Three ranks through the real relay: the console's matching lines of ranks 0 and 1, each
    whole and in order; nothing of rank 2, whose output goes to its files only."""
    import queue
    import sys

    from ftrun.config.agent import AgentConfig

    script = (
        "import os, sys\n"
        "r = os.environ['RANK']\n"
        "for i in range(300):\n"
        "    print(f'loss {r} {i} ' + 'x' * 200, flush=True)\n"
        "    print('noise', flush=True)\n"
        "print(f'err loss {r}', file=sys.stderr)\n"
    )
    entry = (sys.executable, "-c", script)
    config = AgentConfig(
        entrypoint=entry,
        nproc_per_node=3,
        redirects={2: 3},
        duplicate_stdout_filters=("loss",),
    )
    events: queue.SimpleQueue[object] = queue.SimpleQueue()
    group = workers.WorkerGroup(config, events)
    cycle = tmp_path / "cycle1"
    envs = [{**os.environ, "RANK": str(rank)} for rank in range(3)]
    group.start(0, envs, cycle, workers.PlainSpawner(entry), lambda _rank, _pid: None)
    for _ in range(3):
        assert events.get(timeout=60).returncode == 0  # type: ignore[attr-defined]
    group.join_threads()
    lines = (cycle / "filtered_stdout.log").read_text().splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[default{rank}]:")]
        assert mine == [f"[default{rank}]:loss {rank} {i} " + "x" * 200 for i in range(300)]
    assert len(lines) == 600
    assert not (cycle / "filtered_stderr.log").exists()  # no stderr filters
    assert (cycle / "rank2" / "stdout.log").read_text().count("loss 2") == 300
