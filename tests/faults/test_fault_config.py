"""Fault matrix, faults of the setting: bad CLI values and YAML, a rendezvous port held by a
foreign listener, an unusable log directory.

Documented outcome for each: one clear line, a non-zero documented exit code (2 for usage
errors, 1 when the store cannot be reached), no traceback, and nothing left running. The same on
both backends: on etcd the launchers name the session's etcd cluster, and the foreign listener
stands where the one etcd member should be.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from launch import free_port
from support import wait_for

if TYPE_CHECKING:
    from conftest import Fault

pytestmark = pytest.mark.faults
USAGE, FAILED = 2, 1
READ_TIMEOUT, JOIN_TIMEOUT = 2, 3
"""For the foreign listener: a store must answer within 2 s, a round close within 3 s."""
FAULT_WORKER = Path(__file__).parents[1] / "workers" / "fault_worker.py"


def argv(fault: Fault, *extra: str) -> list[str]:
    """One node whose one rank makes one step: had the launcher accepted the bad value, it would
    run this job to its end at once and leave logs/ and ckpt/ in the case's directory (see the
    control case). On the session's backend (`fault.rdzv_args`); `extra` comes last and wins."""
    tmp = fault.tmp
    return [
        "--nnodes=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        *fault.rdzv_args,
        f"--rdzv-id=faults-{tmp.name}",
        f"--log-dir={tmp / 'logs'}",
        *extra,
        str(FAULT_WORKER),
        "--ckpt-dir",
        str(tmp / "ckpt"),
        "--steps",
        "1",
    ]


def created(tmp: Path, *inputs: str) -> list[str]:
    """Paths in the case's directory other than the test's own `inputs`."""
    paths = (str(p.relative_to(tmp)) for p in tmp.rglob("*"))
    return sorted(p for p in paths if p not in inputs)


def assert_usage_error(done: subprocess.CompletedProcess, fragment: str) -> None:
    lines = done.stderr.splitlines()
    assert done.returncode == USAGE, done.stderr
    assert done.stdout == "" and len(lines) == 1, done.stderr
    assert lines[0].startswith("ft_launcher: error: ") and fragment in lines[0], lines[0]


BAD_FLAGS = {
    "nnodes_zero": ("--nnodes=0", "--nnodes"),
    "negative_max_restarts": ("--max-restarts=-1", "--max-restarts"),
    "heartbeat_not_a_number": ("--ft-rank-heartbeat-timeout=abc", "--ft-rank-heartbeat-timeout"),
    "section_without_seconds": ("--ft-rank-section-timeouts=step", "--ft-rank-section-timeouts"),
    "bad_rdzv_conf_value": ("--rdzv-conf=join_timeout=x", "join_timeout"),
    "unknown_option": ("--ft-no-such-option=1", "--ft-no-such-option"),
}


@pytest.mark.parametrize(("flag", "fragment"), BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_bad_cli_value(fault: Fault, flag: str, fragment: str):
    done = fault.run_launcher(argv(fault, flag))
    fault.expect = "exit 2"
    assert created(fault.tmp) == [], f"a job ran despite {flag}: {done.stderr[-2000:]}"
    assert_usage_error(done, fragment)


BAD_YAML = {
    "syntax": ("fault_tolerance:\n  rank_heartbeat_timeout: [1\n", "bad YAML"),
    "unknown_key": ("fault_tolerance:\n  rank_heartbet_timeout: 5\n", "rank_heartbeat_timeout?"),
    "negative_timeout": ("fault_tolerance:\n  rank_heartbeat_timeout: -3\n", "got -3"),
    "not_utf8": (b"fault_tolerance:\n  log_level: \xff\xfe\n", "not UTF-8"),
    "missing_file": (None, "No such file or directory"),
}


@pytest.mark.parametrize(("text", "fragment"), BAD_YAML.values(), ids=BAD_YAML.keys())
def test_bad_yaml(fault: Fault, text: str | bytes | None, fragment: str):
    path = fault.tmp / "ft.yaml"
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    done = fault.run_launcher(argv(fault, f"--ft-cfg-path={path}"))
    fault.expect = "exit 2"
    assert created(fault.tmp, "ft.yaml") == [], f"a job ran despite it: {done.stderr[-2000:]}"
    assert_usage_error(done, fragment)


def test_control_the_same_command_line_without_a_fault_runs_a_job(fault: Fault):
    """The control of the cases above: without the bad value the same command line runs its job
    and leaves the agent's events and the rank's files behind, so an empty case directory there
    means nothing was started."""
    done = fault.run_launcher(argv(fault))
    fault.expect = "exit 0"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    made = created(fault.tmp)
    assert [p for p in made if p.startswith("logs/events-")], made
    assert "ckpt/done-rank0" in made, made


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file"])
def test_log_dir_not_writable(fault: Fault, where: str):
    """We run as root, so chmod cannot make a directory unwritable: use a regular file."""
    blocker = fault.tmp / "blocker"
    blocker.write_text("a regular file\n")
    log_dir = blocker / "logs" if where == "under_a_file" else blocker
    args = argv(fault, f"--log-dir={log_dir}")  # the later --log-dir wins
    done = fault.run_launcher(args)
    fault.expect = "exit 2"
    output = done.stdout + done.stderr
    assert done.returncode == USAGE, output
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if str(log_dir) in line]
    assert len(errors) == 1 and "Not a directory" in errors[0], output
    assert blocker.read_text() == "a regular file\n"


def test_rendezvous_port_held_by_a_foreign_listener(fault: Fault):
    """A plain socket listens on the rendezvous port (and never answers): the launcher cannot
    serve the store there and must not wait forever for one that will never talk. On etcd the
    endpoint names that socket as the only etcd member: it accepts and never answers."""
    fault.expect = "exit 1"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        conf = f"--rdzv-conf=read_timeout={READ_TIMEOUT},join_timeout={JOIN_TIMEOUT}"
        # The foreign endpoint last: it wins over the session backend's (`Fault.start`).
        job = fault.start(1, [conf, f"--rdzv-endpoint=127.0.0.1:{port}"], ["--steps", "1"],
                          script=FAULT_WORKER)  # fmt: skip
        # The events file is opened just before the agent reaches for the store.
        wait_for(lambda: list(job.log_dir.glob("events-*.jsonl")), 60, "agent")
        started = time.monotonic()
        # `Job.wait` fails the case (and kills the launcher) if it is still running then.
        [code] = job.wait(timeout=READ_TIMEOUT + JOIN_TIMEOUT + 3)
        fault.time(time.monotonic() - started, "agent started to exit")
    text = job.nodes[0].text()
    assert code == FAILED, text
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], text
