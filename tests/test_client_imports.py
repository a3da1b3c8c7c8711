"""What importing the in-worker client costs a training script: no server, no psutil, no torch.

Each check runs in a fresh interpreter, since this one has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import ftrun.rank_monitor

FORBIDDEN_PREFIXES = ("ftrun.rank_monitor.server", "ftrun.agent", "ftrun.tools", "psutil", "torch")


def modules_after(code: str) -> list[str]:
    """The modules loaded once `code` ran in a fresh interpreter."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "code",
    [
        "import ftrun.client_lib",
        "from ftrun.client_lib import RankMonitorClient; RankMonitorClient()",
        "from ftrun.rank_monitor import protocol, RankMonitorConfig, HangKind",
    ],
)
def test_the_client_loads_no_server_module_and_no_psutil(code: str) -> None:
    loaded = modules_after(code)
    assert "ftrun.client_lib" in loaded or "ftrun.rank_monitor" in loaded
    forbidden = [m for m in loaded if m.startswith(FORBIDDEN_PREFIXES)]
    assert forbidden == []


def test_the_server_still_loads_on_first_use() -> None:
    loaded = modules_after("from ftrun.rank_monitor import RankMonitorServer, Verdict")
    assert "ftrun.rank_monitor.server" in loaded and "psutil" in loaded
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        _ = ftrun.rank_monitor.Nope  # type: ignore[attr-defined]
