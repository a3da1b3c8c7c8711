"""A real etcd cluster on 127.0.0.1 for tests: N members (Debian's `etcd-server`), each in its
own data directory under the test's tmp dir, started and stopped by the test.

`make test` installs etcd (tests/etcd/install-etcd.sh); without the binary, `etcd_binary()`
skips the test saying so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from launch import free_port
from support import wait_for

START_S = 30.0


def etcd_binary() -> str:
    found = os.environ.get("FTRUN_ETCD") or shutil.which("etcd") or "/usr/bin/etcd"
    if not os.access(found, os.X_OK):
        pytest.skip("no etcd binary (FTRUN_ETCD, PATH, /usr/bin/etcd); tests/etcd/install-etcd.sh "
                    "installs Debian's etcd-server")  # fmt: skip
    return found


class MemberExited(Exception):
    """An etcd member's process ended while the cluster started."""


@dataclasses.dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def healthy(self) -> bool:
        try:
            url = f"http://{self.endpoint}/health"
            with urllib.request.urlopen(url, timeout=1) as answer:
                return b'"true"' in answer.read()
        except OSError:
            return False

    def leads(self) -> bool:
        """Whether this member is the cluster's leader (its own status says so)."""
        url = f"http://{self.endpoint}/v3/maintenance/status"
        request = urllib.request.Request(url, data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            status = json.loads(answer.read())
        return status["leader"] == status["header"]["member_id"]


class EtcdCluster:
    """`members` etcd processes forming one cluster; `kill(i)` and `start(i)` one of them."""

    def __init__(self, tmp: Path, members: int = 3) -> None:
        self.binary = etcd_binary()
        self._tmp, self._size = tmp, members
        self._place(attempt=0)

    def _place(self, attempt: int) -> None:
        """Fresh ports and data directories for every member (`attempt` names them apart)."""
        self.members = [
            Member(f"m{i}", free_port(), free_port(), self._tmp / f"etcd-m{i}-{attempt}",
                   self._tmp / f"etcd-m{i}-{attempt}.log")
            for i in range(self._size)
        ]  # fmt: skip
        self._initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)

    def bootstrap(self, attempts: int = 3) -> None:
        """Start the whole cluster. A member that exits at once lost its port to another test
        (ports are picked free, then bound by etcd later): the cluster starts again elsewhere."""
        for attempt in range(attempts):
            if attempt:
                self.stop()
                self._place(attempt)
            try:
                self.start()
                return
            except MemberExited:
                continue
        raise AssertionError(f"etcd did not start in {attempts} tries:\n{self.log_tails()}")

    def log_tails(self, lines: int = 5) -> str:
        return "\n".join(
            f"{m.name}: " + " | ".join(m.log.read_text(errors="replace").splitlines()[-lines:])
            for m in self.members if m.log.exists()
        )  # fmt: skip

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, index: int | None = None) -> None:
        for member in self.members if index is None else [self.members[index]]:
            self._start(member)
        try:
            wait_for(self._healthy, START_S, "etcd healthy")
        except AssertionError as failure:
            raise AssertionError(f"{failure}\n{self.log_tails()}") from None

    def _healthy(self) -> bool:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is not None:
                raise MemberExited(f"etcd {m.name} exited with {m.proc.returncode}")
        return all(m.healthy() for m in self.members if m.proc)

    def _start(self, m: Member) -> None:
        argv = [
            self.binary, "--name", m.name, "--data-dir", str(m.data_dir),
            "--listen-client-urls", f"http://{m.endpoint}",
            "--advertise-client-urls", f"http://{m.endpoint}",
            "--listen-peer-urls", f"http://127.0.0.1:{m.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer_port}",
            "--initial-cluster", self._initial, "--initial-cluster-token", "ftrun-test",
            "--initial-cluster-state", "new", "--heartbeat-interval", "50",
            "--election-timeout", "500",
        ]  # fmt: skip
        with m.log.open("ab") as out:
            m.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)  # fmt: skip

    def leader(self) -> int:
        """The index of the member that leads now."""
        found = [i for i, m in enumerate(self.members) if m.proc is not None and m.leads()]
        assert len(found) == 1, f"leaders: {found}"
        return found[0]

    def kill(self, index: int) -> None:
        m = self.members[index]
        if m.proc is not None and m.proc.poll() is None:
            os.killpg(m.proc.pid, signal.SIGKILL)
            m.proc.wait(timeout=10)
        m.proc = None

    def stop(self) -> None:
        for index in range(len(self.members)):
            self.kill(index)
