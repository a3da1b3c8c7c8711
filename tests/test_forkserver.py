"""The per-node fork server (ftrun.agent.prewarm): real server, real forked workers, deadlines.

Every test closes its server; the suite's autouse fixture then checks that no process is left.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import pytest

from ftrun.agent.exits import ExitWaiter
from ftrun.agent.prewarm import wire as proto
from ftrun.agent.prewarm.child import CHILD_BROKEN
from ftrun.agent.prewarm.client import ForkedWorker, ForkServer, ForkServerError
from ftrun.agent.prewarm.prestart import HeldWorker
from ftrun.agent.prewarm.target import PythonTarget
from ftrun.errors import FtrunError
from support import WORKERS, wait_for

pytestmark = pytest.mark.process

PROBE = str(WORKERS / "forked_probe.py")
BASE_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
DEADLINE = 20.0


def probe(*args: str) -> PythonTarget:
    return PythonTarget(False, PROBE, args)


@pytest.fixture
def server() -> Iterator[ForkServer]:
    fs = ForkServer.start(["email.mime.text", "no_such_module_xyz"], BASE_ENV)
    try:
        assert fs.ready(DEADLINE), fs.error
        yield fs
    finally:
        fs.close()


def finish(worker: ForkedWorker) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of a worker that ends by itself."""
    code = worker.wait(DEADLINE)
    with worker.stdout, worker.stderr:
        return code, worker.stdout.read().decode(), worker.stderr.read().decode()


def readline(stream: IO[bytes], timeout: float = DEADLINE) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, "no output from the worker in time"
    return stream.readline().decode()


def run_report(server: ForkServer, *args: str, **kwargs: Any) -> dict[str, Any]:
    code, out, err = finish(server.spawn(probe("report", *args), **kwargs))
    assert code == 0, err
    return json.loads(out)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---- how workers end -------------------------------------------------------------------------


def test_exit_codes_as_python_would_give_them(server: ForkServer) -> None:
    assert finish(server.spawn(probe("report", "0"), BASE_ENV, os.getcwd()))[0] == 0
    assert finish(server.spawn(probe("report", "3"), BASE_ENV, os.getcwd()))[0] == 3

    code, _, err = finish(server.spawn(probe("raise"), BASE_ENV, os.getcwd()))
    assert code == 1
    assert err.startswith("Traceback (most recent call last):\n"), err
    assert "RuntimeError: boom" in err
    assert "forkserver.py" not in err and "runpy" not in err, err  # only the script's frames

    code, out, err = finish(server.spawn(probe("sysexit", "bad input"), BASE_ENV, os.getcwd()))
    assert (code, out, err) == (1, "", "bad input\n")

    code, _, err = finish(server.spawn(probe("interrupt"), BASE_ENV, os.getcwd()))
    assert code == -signal.SIGINT and "KeyboardInterrupt" in err

    worker = server.spawn(probe("sleep"), BASE_ENV, os.getcwd())
    assert readline(worker.stdout) == "sleeping\n"
    assert worker.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(0.05)
    os.killpg(worker.pid, signal.SIGKILL)
    assert finish(worker)[0] == -signal.SIGKILL
    assert worker.returncode == worker.poll() == -signal.SIGKILL


def test_script_runs_in_a_lasting_main_module_like_python(
    server: ForkServer, tmp_path: Path
) -> None:
    script = tmp_path / "pickles.py"
    script.write_text(
        "import atexit, pickle, sys\n"
        "class Job: pass\n"
        "atexit.register(lambda: print(type(pickle.loads(pickle.dumps(Job()))).__module__))\n"
        "print(sys.modules['__main__'].__file__, __loader__.name, __spec__, __package__)\n"
    )
    code, out, err = finish(server.spawn(PythonTarget(False, str(script), ()), BASE_ENV, "/"))
    assert (code, err) == (0, "")
    assert out == f"{script} __main__ None None\n__main__\n"


def test_syntax_error_reads_as_pythons(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("def (:\n")
    plain = subprocess.run(
        [sys.executable, "-u", str(script)], capture_output=True, timeout=60, check=False
    )
    code, _, err = finish(server.spawn(PythonTarget(False, str(script), ()), BASE_ENV, "/"))
    assert (code, err) == (plain.returncode, plain.stderr.decode())


def test_interpreter_end_joins_threads_and_runs_atexit(server: ForkServer) -> None:
    code, out, _ = finish(server.spawn(probe("finale"), BASE_ENV, os.getcwd()))
    assert (code, out) == (0, "main done\nthread done\natexit ran\n")


def test_missing_script_is_exit_2_with_pythons_message(server: ForkServer, tmp_path: Path) -> None:
    missing = tmp_path / "missing.py"
    code, out, err = finish(server.spawn(PythonTarget(False, str(missing), ()), BASE_ENV, "/"))
    assert code == 2 and out == ""
    why = "[Errno 2] No such file or directory"
    assert err == f"{sys.executable}: can't open file {str(missing)!r}: {why}\n"


def test_same_outcome_as_a_plain_python(server: ForkServer) -> None:
    for args in (("raise",), ("sysexit", "msg"), ("report", "7")):
        plain = subprocess.run(
            [sys.executable, "-u", PROBE, *args],
            env=BASE_ENV,
            capture_output=True,
            timeout=60,
            check=False,
        )
        code, _, err = finish(server.spawn(probe(*args), BASE_ENV, os.getcwd()))
        assert code == plain.returncode
        assert err.splitlines()[-1:] == plain.stderr.decode().splitlines()[-1:]


# ---- what a worker sees ----------------------------------------------------------------------


def test_env_cwd_argv_stdio_and_process_group(server: ForkServer, tmp_path: Path) -> None:
    env = {**BASE_ENV, "RANK": "5", "ONLY_HERE": "x y"}
    env.pop("HOME", None)
    worker = server.spawn(probe("report", "0", "--flag"), env, str(tmp_path))
    code, out, err = finish(worker)
    assert code == 0, err
    seen = json.loads(out)
    assert seen["env"] == env
    assert seen["cwd"] == str(tmp_path)
    assert seen["argv"] == [PROBE, "report", "0", "--flag"]
    assert seen["orig_argv"] == [sys.executable, "-u", PROBE, "report", "0", "--flag"]
    assert seen["path0"] == str(WORKERS)
    assert (seen["name"], seen["file"]) == ("__main__", PROBE)
    assert seen["pid"] == worker.pid
    assert seen["pgid"] == seen["sid"] == worker.pid  # leads its own session and group
    assert seen["ppid"] == server.pid
    assert seen["stdin"] == "/dev/null"
    assert seen["fds"][:3] == [0, 1, 2] and len(seen["fds"]) <= 4  # + the listdir fd
    assert seen["threads"] == 1
    assert seen["write_through"] and not seen["line_buffering"] and seen["stdout_is_original"]
    assert seen["modules"] == ["email.mime.text"]  # prewarmed; the broken one was swallowed
    assert err == ""


def test_relative_script_resolves_against_cwd(server: ForkServer) -> None:
    target = PythonTarget(False, "forked_probe.py", ("report",))
    code, out, err = finish(server.spawn(target, BASE_ENV, str(WORKERS)))
    assert code == 0, err
    seen = json.loads(out)
    assert seen["argv"][0] == "forked_probe.py"
    assert (seen["file"], seen["path0"]) == (PROBE, str(WORKERS))


def test_each_worker_gets_fresh_random_state() -> None:
    with ForkServer.start(["numpy.random"], BASE_ENV) as fs:
        assert fs.ready(DEADLINE), fs.error
        first, second = (run_report(fs, env=BASE_ENV, cwd="/") for _ in range(2))
    assert first["modules"] == ["numpy"]
    assert first["random"] != second["random"]
    assert first["numpy_random"] != second["numpy_random"]


def test_module_target(server: ForkServer, tmp_path: Path) -> None:
    pkg = tmp_path / "fs_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(
        "import json, sys\n"
        "print(json.dumps([sys.argv, sys.path[0], __name__, __spec__.name]))\n"
        "sys.exit(4)\n"
    )
    code, out, err = finish(
        server.spawn(PythonTarget(True, "fs_pkg.main", ("a", "b")), BASE_ENV, str(tmp_path))
    )
    assert code == 4, err
    argv, path0, name, spec = json.loads(out)
    assert argv == [str(pkg / "main.py"), "a", "b"]
    assert (path0, name, spec) == (str(tmp_path), "__main__", "fs_pkg.main")

    code, out, err = finish(
        server.spawn(PythonTarget(True, "fs_pkg.nothing", ()), BASE_ENV, str(tmp_path))
    )
    assert (code, out) == (1, "")
    assert err == f"{sys.executable}: No module named fs_pkg.nothing\n"


def test_announce_runs_before_the_worker_starts(server: ForkServer, tmp_path: Path) -> None:
    mark = tmp_path / "started"
    announced: list[int] = []

    def announce(pid: int) -> None:
        time.sleep(0.3)
        assert not mark.exists()  # the child waits for us
        announced.append(pid)

    worker = server.spawn(probe("mark", str(mark)), BASE_ENV, "/", announce=announce)
    assert announced == [worker.pid]
    assert finish(worker)[0] == 0 and mark.exists()


def test_failing_announce_kills_the_child(server: ForkServer, tmp_path: Path) -> None:
    mark = tmp_path / "started"
    pids: list[int] = []

    def announce(pid: int) -> None:
        pids.append(pid)
        raise ValueError("monitor says no")

    with pytest.raises(ValueError, match="monitor says no"):
        server.spawn(probe("mark", str(mark)), BASE_ENV, "/", announce=announce)
    wait_for(lambda: gone(pids[0]), DEADLINE, "the unannounced child to die")
    assert not mark.exists()
    assert finish(server.spawn(probe("report"), BASE_ENV, "/"))[0] == 0  # still serving


# ---- the server's life -----------------------------------------------------------------------


def test_killing_the_server_kills_its_workers() -> None:
    fs = ForkServer.start([], BASE_ENV)
    try:
        assert fs.ready(DEADLINE)
        workers = [fs.spawn(probe("sleep"), BASE_ENV, "/") for _ in range(2)]
        for worker in workers:
            assert readline(worker.stdout) == "sleeping\n"
        os.kill(fs.pid, signal.SIGKILL)
        for worker in workers:
            assert worker.wait(DEADLINE) == -signal.SIGKILL  # PDEATHSIG, not the agent
            assert gone(worker.pid)
            worker.stdout.close()
            worker.stderr.close()
        # The client's reader sees the server gone on its own thread, after the workers may.
        wait_for(lambda: not fs.ready(0), DEADLINE, "the client to see the server gone")
        with pytest.raises(ForkServerError) as info:
            fs.spawn(probe("report"), BASE_ENV, "/")
        assert isinstance(info.value, FtrunError)
    finally:
        fs.close()
    fs.close()  # idempotent


AGENT = """
import os, sys, time
from ftrun.agent.prewarm.client import ForkServer
from ftrun.agent.prewarm.target import PythonTarget
fs = ForkServer.start([], dict(os.environ))
assert fs.ready(20)
worker = fs.spawn(PythonTarget(False, sys.argv[1], ("sleep",)), dict(os.environ), "/")
assert worker.stdout.readline() == b"sleeping\\n"
print(fs.pid, worker.pid, flush=True)
time.sleep(600)
"""


def test_server_and_workers_die_with_the_agent() -> None:
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, PROBE], env=BASE_ENV, stdout=subprocess.PIPE
    )
    try:
        assert agent.stdout is not None
        server_pid, worker_pid = map(int, readline(agent.stdout).split())
        assert not gone(server_pid) and not gone(worker_pid)
    finally:
        agent.kill()
        agent.wait(DEADLINE)
        agent.stdout.close()  # type: ignore[union-attr]
    for pid in (server_pid, worker_pid):
        wait_for(lambda p=pid: gone(p), DEADLINE, f"pid {pid} to die with the agent")


def test_close_kills_workers_and_their_groups(tmp_path: Path) -> None:
    fs = ForkServer.start(["email.mime.text"], BASE_ENV)
    assert fs.ready(DEADLINE)
    worker = fs.spawn(probe("grandchild"), BASE_ENV, "/")
    grandchild = int(readline(worker.stdout))
    server_pid = fs.pid
    fs.close()
    assert worker.wait(0) == -signal.SIGKILL  # resolved by the time close returns
    for pid in (server_pid, worker.pid, grandchild):
        wait_for(lambda p=pid: gone(p), DEADLINE, f"pid {pid} to exit")
    worker.stdout.close()
    worker.stderr.close()
    with pytest.raises(ForkServerError, match="closed"):
        fs.spawn(probe("report"), BASE_ENV, "/")


def test_close_while_still_importing() -> None:
    fs = ForkServer.start(["torch"], BASE_ENV)
    started = time.monotonic()
    fs.close()
    assert time.monotonic() - started < 3
    assert not fs.ready(0)


def test_grandchild_dies_with_the_workers_group(server: ForkServer) -> None:
    worker = server.spawn(probe("grandchild"), BASE_ENV, "/")
    grandchild = int(readline(worker.stdout))
    assert os.getpgid(grandchild) == worker.pid
    os.killpg(worker.pid, signal.SIGKILL)
    assert finish(worker)[0] == -signal.SIGKILL
    wait_for(lambda: gone(grandchild), DEADLINE, "the grandchild to exit")


def test_spawn_after_server_exit_raises() -> None:
    fs = ForkServer.start([], BASE_ENV)
    try:
        assert fs.ready(DEADLINE)
        os.kill(fs.pid, signal.SIGKILL)
        wait_for(lambda: fs.error is not None, DEADLINE, "the client to notice")
        with pytest.raises(ForkServerError, match="exited"):
            fs.spawn(probe("report"), BASE_ENV, "/")
    finally:
        fs.close()


def test_server_that_cannot_start() -> None:
    env = {**BASE_ENV, "PYTHONHOME": "/nonexistent"}  # the interpreter cannot start
    fs = ForkServer.start([], env)
    try:
        assert not fs.ready(DEADLINE)
        with pytest.raises(ForkServerError, match="exited"):
            fs.spawn(probe("report"), env, "/")
    finally:
        fs.close()


# ---- refusals: the caller spawns plainly -----------------------------------------------------


def test_refuses_when_a_prewarm_module_started_a_thread(tmp_path: Path) -> None:
    (tmp_path / "threaded_mod.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True, name='bg').start()\n"
    )
    env = {**BASE_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    with ForkServer.start(["threaded_mod"], env) as fs:
        assert not fs.ready(DEADLINE)
        assert fs.error is not None and "threads ['bg']" in fs.error
        with pytest.raises(ForkServerError, match="threads"):
            fs.spawn(probe("report"), env, "/")


def test_refuses_when_a_native_thread_runs(tmp_path: Path) -> None:
    """A thread that Python's threading module does not know of (as a native library's)."""
    (tmp_path / "raw_thread_mod.py").write_text(
        "import _thread, time\n_thread.start_new_thread(time.sleep, (600,))\n"
    )
    env = {**BASE_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    with ForkServer.start(["raw_thread_mod"], env) as fs:
        assert not fs.ready(DEADLINE)
        assert fs.error is not None and "2 OS threads" in fs.error
        with pytest.raises(ForkServerError, match="OS threads"):
            fs.spawn(probe("report"), env, "/")


def test_refuses_a_worker_whose_startup_env_differs(server: ForkServer) -> None:
    for name, value in (("OMP_NUM_THREADS", "8"), ("PYTHONHASHSEED", "0"), ("LD_PRELOAD", "x")):
        with pytest.raises(ForkServerError, match=name):
            server.spawn(probe("report"), {**BASE_ENV, name: value}, "/")
    assert run_report(server, env={**BASE_ENV, "RANK": "1"}, cwd="/")["env"]["RANK"] == "1"


def test_refuses_a_missing_cwd_and_keeps_serving(server: ForkServer, tmp_path: Path) -> None:
    with pytest.raises(ForkServerError, match="not a directory"):
        server.spawn(probe("report"), BASE_ENV, str(tmp_path / "nope"))
    with pytest.raises(ForkServerError, match="invalid environment"):
        server.spawn(probe("report"), {**BASE_ENV, "A=B": "c"}, "/")
    assert server.ready(0)
    assert run_report(server, env=BASE_ENV, cwd="/")["cwd"] == "/"


# ---- the control protocol --------------------------------------------------------------------


def _send_raw(fs: ForkServer, data: bytes) -> None:
    with fs._send_lock:
        fs._sock.sendall(data)


def test_server_rejects_malformed_messages_and_goes_on(
    server: ForkServer, caplog: pytest.LogCaptureFixture
) -> None:
    header = proto.HEADER.pack
    bad = [
        b"not json",
        b"[1, 2]",
        json.dumps({"v": 99, "op": "spawn"}).encode(),
        json.dumps({"v": 1, "op": "fork_bomb"}).encode(),
        json.dumps({"v": 1, "op": "spawn", "id": 1}).encode(),
        proto.encode(
            "spawn",
            id=1,
            module=False,
            target=PROBE,
            args=[1],
            env={},
            cwd="/",
            gate=False,
            cuda_device=None,
        )[4:],
    ]
    with caplog.at_level("WARNING", logger="ftrun.agent"):
        for payload in bad:
            _send_raw(server, header(len(payload)) + payload)
        wait_for(
            lambda: sum("rejected" in r.getMessage() for r in caplog.records) == len(bad),
            DEADLINE,
            "the server to reject every malformed message",
        )
    assert server.ready(0)
    assert run_report(server, env=BASE_ENV, cwd="/")["pid"] > 0


def test_server_stops_on_a_broken_frame() -> None:
    fs = ForkServer.start([], BASE_ENV)
    try:
        assert fs.ready(DEADLINE)
        worker = fs.spawn(probe("sleep"), BASE_ENV, "/")
        _send_raw(fs, proto.HEADER.pack(proto.MAX_FRAME + 1))
        assert worker.wait(DEADLINE) == -signal.SIGKILL
        worker.stdout.close()
        worker.stderr.close()
        wait_for(lambda: not fs.ready(0), DEADLINE, "the server to stop")
        with pytest.raises(ForkServerError):
            fs.spawn(probe("report"), BASE_ENV, "/")
    finally:
        fs.close()


def test_client_rejects_a_server_that_breaks_the_protocol() -> None:
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ours, theirs = socket.socketpair()
    fs = ForkServer(stand_in, ours, BASE_ENV, (), ready_timeout=DEADLINE)
    fs._reader.start()
    try:
        theirs.sendall(proto.encode("hello", pid=stand_in.pid))
        theirs.sendall(proto.encode("spawned", id=1, pid="1"))  # wrong type
        wait_for(fs._gone.is_set, DEADLINE, "the client to drop the server")
        assert fs.error is not None and "broke the protocol" in fs.error
        assert stand_in.poll() == -signal.SIGKILL
        with pytest.raises(ForkServerError, match="protocol"):
            fs.spawn(probe("report"), BASE_ENV, "/")
    finally:
        theirs.close()
        fs.close()
        stand_in.kill()
        stand_in.wait(DEADLINE)


@pytest.mark.parametrize(
    "message",
    [
        {"op": "exit", "pid": 1, "code": 0},  # no version
        {"v": 2, "op": "exit", "pid": 1, "code": 0},
        {"v": 1, "op": "exit", "pid": 1},
        {"v": 1, "op": "exit", "pid": 1, "code": True},
        {"v": 1, "op": "exit", "pid": 1, "code": 0, "extra": 1},
        {"v": 1, "op": "spawn"},
        {"v": 1, "op": "error", "id": "x", "error": "e"},
        {"v": 1, "op": "ready", "imported": "torch", "failed": [], "unforkable": None},
    ],
)
def test_decode_rejects(message: dict[str, Any]) -> None:
    with pytest.raises(proto.ProtocolViolation):
        proto.decode(json.dumps(message).encode(), proto.TO_AGENT)


def test_decode_accepts_what_encode_makes() -> None:
    frame = proto.encode("error", id=None, error="e")
    assert proto.decode(frame[4:], proto.TO_AGENT) == {"v": 1, "op": "error", "id": None,
                                                       "error": "e"}  # fmt: skip
    frame = proto.encode("spawn", id=3, module=True, target="m", args=["a"], env={"A": "b"},
                         cwd="/", gate=True, cuda_device=None)  # fmt: skip
    assert proto.decode(frame[4:], proto.TO_SERVER)["env"] == {"A": "b"}
    with pytest.raises(proto.ProtocolViolation):
        proto.decode(frame[4:], proto.TO_AGENT)  # a request is no reply


# ---- prestarted workers (prewarm/prestart.py) -------------------------------------------------


def test_a_prestarted_worker_runs_with_the_environment_of_its_go(server: ForkServer) -> None:
    """Made with one cycle's environment, it runs the script with the next one's; the script
    sees only what a worker forked at that moment would (fds, stdio, signals, cwd)."""
    made_with = {**BASE_ENV, "FTRUN_CYCLE": "0", "LOCAL_RANK": "0"}
    worker, gate = server.prestart(probe("report"), made_with, "/", cuda_device=0)
    held = HeldWorker(worker, gate, made_with)
    assert held.fits({**made_with, "FTRUN_CYCLE": "1", "RANK": "4"}) is None
    assert "USER_VAR" in (held.fits({**made_with, "USER_VAR": "x"}) or "")
    spawned = run_report(server, env=made_with, cwd="/")
    assert worker.poll() is None  # it waits for the go
    held.release({**made_with, "FTRUN_CYCLE": "1"})
    code, out, err = finish(worker)
    assert (code, err) == (0, "")
    seen = json.loads(out)
    assert seen["env"]["FTRUN_CYCLE"] == "1" and seen["cwd"] == "/"
    same = ("fds", "stdin", "handlers", "threads", "modules", "path0", "write_through")
    assert {k: seen[k] for k in same} == {k: spawned[k] for k in same}
    assert seen["pgid"] == seen["sid"] == worker.pid


def test_a_prestarted_worker_imports_what_its_preload_names_before_the_go(
    server: ForkServer,
) -> None:
    """A module that does not import is left for the script (no error, no output)."""
    worker, gate = server.prestart(probe("report"), BASE_ENV, "/", cuda_device=0)
    held = HeldWorker(worker, gate, BASE_ENV)
    held.preload(("no_such_module_for_ftrun", "colorsys"))
    held.release(BASE_ENV)
    code, out, err = finish(worker)
    assert (code, err) == (0, "")
    assert json.loads(out)["colorsys"] is True
    assert run_report(server, env=BASE_ENV, cwd="/")["colorsys"] is False


def test_a_withdrawn_prestarted_worker_leaves_no_process(server: ForkServer) -> None:
    worker, gate = server.prestart(probe("report"), BASE_ENV, "/", cuda_device=0)
    HeldWorker(worker, gate, BASE_ENV).discard()
    assert worker.wait(DEADLINE) in (-signal.SIGKILL, CHILD_BROKEN)
    wait_for(lambda: gone(worker.pid), DEADLINE, "the withdrawn worker to go")
    # The gate closed without a "go" before the kill lands: the child leaves by itself.
    worker, gate = server.prestart(probe("report"), BASE_ENV, "/", cuda_device=0)
    os.close(gate)
    assert worker.wait(DEADLINE) == CHILD_BROKEN
    worker.stdout.close()
    worker.stderr.close()


def test_a_prestart_without_a_start_gate_is_refused(
    server: ForkServer, caplog: pytest.LogCaptureFixture
) -> None:
    frame = proto.encode("spawn", id=99, module=False, target=PROBE, args=[], env={}, cwd="/",
                         gate=False, cuda_device=0)  # fmt: skip
    with caplog.at_level("WARNING", logger="ftrun.agent"):
        _send_raw(server, frame)
        wait_for(
            lambda: any("needs a start gate" in r.getMessage() for r in caplog.records),
            DEADLINE, "the server to refuse the prestart",
        )  # fmt: skip
    assert run_report(server, env=BASE_ENV, cwd="/")["pid"] > 0


# ---- with torch, as the agent will use it ----------------------------------------------------


def test_torch_prewarmed_server_forks_workers() -> None:
    with ForkServer.start(["torch"], BASE_ENV) as fs:
        assert fs.ready(120), fs.error
        assert fs.imported == ("torch",)
        first = run_report(fs, env=BASE_ENV, cwd="/")
        second = run_report(fs, env=BASE_ENV, cwd="/")
    # The probe never imports torch: finding it loaded means the worker got it from the server.
    assert "torch" in first["modules"]
    assert first["torch_seed"] != second["torch_seed"]  # as two fresh interpreters


def test_many_concurrent_spawns(server: ForkServer) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        code = finish(server.spawn(probe("report", "5"), BASE_ENV, "/"))[0]
        with lock:
            results.append(code)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE)
    assert results == [5] * 8


def test_a_worker_that_ends_while_the_server_imports_is_seen_at_once() -> None:
    """The server reaps nobody while it imports a deep module (3 s here): the worker's end is
    read from /proc, not waited for until the server sends its note."""
    env = {**BASE_ENV, "PYTHONPATH": str(WORKERS), "SLOW_PREWARM_S": "3"}
    with ForkServer.start(["json"], env) as fs:
        assert fs.ready(DEADLINE), fs.error
        worker = fs.spawn(probe("sleep"), env, os.getcwd())
        assert readline(worker.stdout) == "sleeping\n"
        assert fs.deepen(["slow_prewarm_module"])
        began = time.monotonic()
        os.killpg(worker.pid, signal.SIGKILL)
        assert worker.wait(DEADLINE) == -signal.SIGKILL
        assert time.monotonic() - began < 1.5, "waited for the server's import"
        assert finish(fs.spawn(probe("report", "0"), env, os.getcwd()))[0] == 0  # after it
        worker.stdout.close()
        worker.stderr.close()


def test_one_waiter_tells_the_ends_of_forked_and_plain_workers_at_once() -> None:
    """The agent's exit waiter, on pidfds: a forked worker killed while the server imports (it
    reaps nobody: the status is the zombie's) and a plain child that exits 3, each told once."""
    env = {**BASE_ENV, "PYTHONPATH": str(WORKERS), "SLOW_PREWARM_S": "3"}
    told: queue.SimpleQueue[tuple[str, int, float]] = queue.SimpleQueue()
    plain = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"], stdin=subprocess.PIPE
    )
    waiter = ExitWaiter("test-exits")
    try:
        with ForkServer.start(["json"], env) as fs:
            assert fs.ready(DEADLINE), fs.error
            forked = fs.spawn(probe("sleep"), env, os.getcwd())
            assert readline(forked.stdout) == "sleeping\n"
            waiter.watch(forked, lambda code: told.put(("forked", code, time.monotonic())))
            waiter.watch(plain, lambda code: told.put(("plain", code, time.monotonic())))
            waiter.seal()
            assert fs.deepen(["slow_prewarm_module"])
            began = time.monotonic()
            os.killpg(forked.pid, signal.SIGKILL)
            what, code, at = told.get(timeout=DEADLINE)
            assert (what, code) == ("forked", -signal.SIGKILL)
            assert at - began < 1.5, "waited for the server's import"
            assert plain.stdin is not None
            plain.stdin.close()
            assert told.get(timeout=DEADLINE)[:2] == ("plain", 3)
            assert waiter.close(DEADLINE)  # it had ended by itself
            forked.stdout.close()
            forked.stderr.close()
    finally:
        waiter.close(DEADLINE)
        if plain.poll() is None:
            plain.kill()
        plain.wait(DEADLINE)
