"""Every code block of README.md and docs/ does what it shows, as a reader copies it
(tests/doc_blocks.py says how each kind of block is checked and how a block asks to be run).

The blocks marked `python run` are run as the training script of a one-node CPU job (2 ranks,
gloo on 127.0.0.1) under `ft_launcher`, with what the reader's script has around them: the
reader's names (`READER_NAMES`) defined before the block, and a fault where the block is about
recovering from one. A launcher command from the docs is used as written where there is one,
its cluster values replaced by this host's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import doc_blocks
from doc_blocks import Block, all_blocks, check_command, commands
from ftrun.errors import ExitCode
from launch import prewarm_args
from support import free_port

BLOCKS = all_blocks()
LAUNCHER = Path(sys.executable).parent / "ft_launcher"
JOB_TIMEOUT_S = 120


def _ids(block: Block) -> str:
    return block.where


def _block(document: str, language: str, mark: str = "") -> Block:
    (found,) = [b for b in BLOCKS if b.where.startswith(f"{document}:")
                and b.language == language and b.mark == mark]  # fmt: skip
    return found


# ---- every block, cheaply ----------------------------------------------------------------------


def test_every_block_names_its_language_and_a_known_mark() -> None:
    assert len(BLOCKS) > 20
    for block in BLOCKS:
        assert doc_blocks.LANGUAGES.get(block.language, set()) >= {block.mark}, block.where
    ran = {b.where.split(":")[0] for b in BLOCKS if b.mark == "run"}  # each has its job below
    assert ran == {"README.md", "docs/inprocess.md", "docs/checkpoints.md"}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python"], ids=_ids)
def test_python_block_compiles_and_its_names_resolve(block: Block) -> None:
    assert doc_blocks.python_problems(block) == []


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "bash"], ids=_ids)
def test_shell_block_commands_pass_their_programs_parsers(block: Block) -> None:
    found = commands(block.text)
    assert found
    for words in found:
        check_command(words)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "yaml"], ids=_ids)
def test_yaml_block_parses(block: Block) -> None:
    assert doc_blocks.yaml_problems(block) == []


def test_the_checks_find_what_a_reader_would_trip_on(tmp_path: Path) -> None:
    """Each finding of issue 56 as the checks saw the blocks before."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nfrom ftrun.checkpointing import LocalCheckpointManager\n"
        "request = LocalCheckpointManager('x').save({}, 1, is_async=True)\n"
        "queue.schedule_async_request(request)\n```\n"
        "```python\nfrom ftrun.checkpointing import NoSuchManager\nimport ftrun.inprocess as ip\n"
        "ip.NoWrapper\n```\n"
        "```python\ndef f(:\n```\n",
        encoding="utf-8",
    )
    undefined, unknown, broken = doc_blocks.blocks_of(page)
    assert doc_blocks.python_problems(undefined) == [
        "uses names it does not define or import: queue"
    ]
    assert doc_blocks.python_problems(unknown) == [
        "from ftrun.checkpointing import NoSuchManager: not found",
        "ftrun.inprocess.NoWrapper: not found",
    ]
    assert doc_blocks.python_problems(broken)[0].startswith("does not compile")
    assert doc_blocks.has_name("ftrun.checkpointing", "GlobalCheckpointManager")  # lazy
    with pytest.raises(Exception, match="--ft-rank-heartbeat-timout"):
        check_command(commands("ft_launcher --ft-rank-heartbeat-timout=3 train.py\n")[0])
    with pytest.raises(Exception, match="not supported"):
        check_command(commands("ft_launcher --logs-specs=x ... train.py\n")[0])
    with pytest.raises(AssertionError, match="no check for the program"):
        check_command(["torchrun", "train.py"])
    assert commands("a --x=$HEAD:1 \\\n  ... b  # c\nd &\n") == [["a", "--x=node0:1", "b"], ["d"]]


def test_quotes_of_code_name_a_call_in_that_function() -> None:
    quotes = [(p.name, m) for p in doc_blocks.documents()
              for m in doc_blocks.QUOTE.findall(p.read_text(encoding="utf-8"))]  # fmt: skip
    assert len(quotes) >= 3
    for page, (name, line, function) in quotes:
        assert doc_blocks.quote_problem(name, int(line), function) is None, page
    assert doc_blocks.quote_problem("train_ddp.py", 80, "hang_in_step")  # its def, no call


# ---- the blocks a reader runs --------------------------------------------------------------------


def _launch(tmp: Path, argv: list[str], timeout: float = JOB_TIMEOUT_S) -> tuple[int, str]:
    """`ft_launcher ARGV` in `tmp`; its exit code and console (stdout and stderr)."""
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    console = tmp / "console.log"
    with console.open("wb") as out:
        proc = subprocess.Popen([str(LAUNCHER), *argv], cwd=tmp, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            text = console.read_text(errors="replace")
            raise AssertionError(f"still running after {timeout}s:\n{text}") from None
    return code, console.read_text(errors="replace")


def _script(tmp: Path, prelude: str, block: Block, epilogue: str = "") -> Path:
    script = tmp / "train.py"
    script.write_text(f"{prelude}\n{block.text}\n{epilogue}", encoding="utf-8")
    return script


def _one_node(tmp: Path, script: Path, *extra: str) -> list[str]:
    args = ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--log-dir={tmp / 'logs'}",
            *extra]  # fmt: skip
    return [*args, *prewarm_args(args, script), str(script)]


def _warnings(console: str, logs: Path) -> list[str]:
    """The launcher's WARNING lines, and any worker stderr line that warns. Not the keeper's
    clean-up of node memory that another job's dead agent left on this host (the suite kills
    agents beside this test): a warning about that job, not this one."""
    found = [line for line in console.splitlines()
             if " WARNING " in line and "left by an agent that died" not in line]  # fmt: skip
    for log in logs.glob("**/stderr.log"):
        found += [line for line in log.read_text().splitlines() if "arning" in line]
    return found


FIRST_JOB = """\
import json, os, pathlib, time

saved = pathlib.Path(f"checkpoint-rank{os.environ['RANK']}.json")
checkpoint = json.loads(saved.read_text()) if saved.exists() else {}
first_step = checkpoint.get("step", 0)
data = range(first_step, 10)


def train_step(step):  # rank 1 dies once at step 6; a checkpoint after steps 3 and 7
    time.sleep(0.05)
    if step == 6 and os.environ["RANK"] == "1" and not pathlib.Path("crashed").exists():
        pathlib.Path("crashed").touch()
        os._exit(1)
    if step % 4 == 3:
        saved.write_text(json.dumps({"step": step + 1}))
"""


@pytest.mark.process
def test_first_job_recovers_and_its_report_counts_redone_iterations(tmp_path: Path) -> None:
    """README's "A first job": its launcher command (one node of 2 CPU ranks here) and its
    script; no --log-dir, so the launcher says where its logs and events are, and the report
    read from there counts the iterations redone after the crash."""
    (command,) = [c for b in BLOCKS if b.where.startswith("README.md:") and b.language == "bash"
                  for c in commands(b.text) if c[0] == "ft_launcher"]  # fmt: skip
    here = {"--nnodes": "1", "--nproc-per-node": "2", "--rdzv-endpoint": f"127.0.0.1:{free_port()}"}
    argv = [f"{w.split('=')[0]}={here[w.split('=')[0]]}" if w.split("=")[0] in here else w
            for w in command[1:]]  # fmt: skip
    script = _script(tmp_path, FIRST_JOB, _block("README.md", "python", "run"))
    at = argv.index("train.py")
    code, console = _launch(tmp_path, [*argv[:at], *prewarm_args(argv, script), *argv[at:]])
    assert code == 0, console
    said = re.findall(r"logs and events in (\S+) \(--log-dir not given\)", console)
    assert len(said) == 1 and Path(said[0]).parent == tmp_path, console
    report = subprocess.run(
        [str(LAUNCHER.parent / "ftrun"), "report", "--json", "--no-timeline", said[0]],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    (failure,) = json.loads(report.stdout)["failures"]
    assert failure["redone_iterations"] >= 1, failure


INPROCESS = """\
import os, pathlib, types

import torch

steps = 4


def build_model():
    return torch.nn.Linear(4, 4)


def load_latest(*_):
    return types.SimpleNamespace(step=0)


def save(*_):  # rank 1 raises once, in its first save
    if os.environ["RANK"] == "1" and not pathlib.Path("raised").exists():
        pathlib.Path("raised").touch()
        raise RuntimeError("a fault the docs test injects")
"""


@pytest.mark.process
def test_inprocess_snippet_runs_on_cpu_and_recovers_in_place_without_a_warning(
    tmp_path: Path,
) -> None:
    """docs/inprocess.md's block: a raise in rank 1 restarts the function in both processes
    (no in-job restart is allowed), said in one console line, and nothing warns."""
    script = _script(tmp_path, INPROCESS, _block("docs/inprocess.md", "python", "run"))
    code, console = _launch(tmp_path, _one_node(tmp_path, script, "--max-restarts=0"))
    assert code == 0, console
    restarts = [line for line in console.splitlines() if "in-process restart:" in line]
    assert len(restarts) == 1 and "a fault the docs test injects" in restarts[0], console
    assert _warnings(console, tmp_path / "logs") == restarts


CHECKPOINTS = """\
import os, pathlib

import torch

torch.distributed.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
saved = pathlib.Path(f"saved-rank{os.environ['RANK']}")
step = 2 if saved.exists() else 1
"""
CHECKPOINTS_END = """
if not saved.exists():  # the first cycle ends in a crash: the next one loads the save
    saved.touch()
    os._exit(1)
pathlib.Path(f"loaded-rank{os.environ['RANK']}").write_text(str(ckpt_id.iteration))
"""


@pytest.mark.process
def test_checkpoint_snippet_saves_and_restores_on_one_node_without_a_warning(
    tmp_path: Path,
) -> None:
    """docs/checkpoints.md's block, twice: the first cycle saves step 1 and crashes, the
    second finds and loads it (both ways) and saves step 2."""
    script = _script(tmp_path, CHECKPOINTS, _block("docs/checkpoints.md", "python", "run"),
                     CHECKPOINTS_END)  # fmt: skip
    code, console = _launch(tmp_path, _one_node(tmp_path, script, "--max-restarts=1"))
    assert code == 0, console
    assert [(tmp_path / f"loaded-rank{r}").read_text() for r in (0, 1)] == ["1", "1"]
    assert _warnings(console, tmp_path / "logs") == []


@pytest.mark.parametrize(
    ("target", "says"),
    [(["missing.py"], "missing.py: no such file"), (["-m", "no_such.module"], "no such module")],
)
def test_a_script_or_module_not_found_is_a_usage_error_before_any_worker(
    tmp_path: Path, target: list[str], says: str
) -> None:
    code, console = _launch(tmp_path, ["--nproc-per-node=2", f"--log-dir={tmp_path / 'logs'}",
                                       *target], timeout=60)  # fmt: skip
    assert code == ExitCode.USAGE, console
    assert console.count("\n") == 1 and console.startswith("ft_launcher: error: "), console
    assert says in console
    assert not (tmp_path / "logs").exists()  # nothing started: not even the log directory
