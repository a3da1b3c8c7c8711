"""Where the workers' torch.compile caches go: torch's own default when it is safe to load code
from, else the user's private directory, else none (no processes; the wiring through a job's
cycles: tests/test_prewarm_cycles.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ftrun.agent.node_services.compile_cache import (
    CACHE_VARIABLE,
    DISABLE_VARIABLE,
    prepare_compile_caches,
    private_cache_dir,
    torch_default_cache_dir,
)


@pytest.fixture
def environ(tmp_path: Path) -> dict[str, str]:
    return {"TMPDIR": str(tmp_path)}


def test_the_default_is_torchs_own(environ, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TMPDIR", environ["TMPDIR"])
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    assert str(torch_default_cache_dir(environ)) == default_cache_dir()


def test_a_new_default_is_made_private_and_the_workers_need_nothing(environ):
    assert prepare_compile_caches(environ) == {}
    made = torch_default_cache_dir(environ)
    assert made.stat().st_mode & 0o777 == 0o700


def test_a_default_that_torch_made_readable_is_used_as_torchrun_would(environ):
    torch_default_cache_dir(environ).mkdir(mode=0o755)
    os.chmod(torch_default_cache_dir(environ), 0o755)  # the umask may have taken bits
    assert prepare_compile_caches(environ) == {}
    assert not private_cache_dir(environ).exists()  # nothing made per job or per user


def test_the_users_own_setting_is_left_alone(environ):
    assert prepare_compile_caches({**environ, CACHE_VARIABLE: "/somewhere"}) == {}
    assert not torch_default_cache_dir(environ).exists()


@pytest.mark.parametrize("unsafe", ["group-writable", "world-writable", "symlink", "file"])
def test_an_unsafe_default_sends_the_workers_to_the_private_one(environ, tmp_path, unsafe, caplog):
    default = torch_default_cache_dir(environ)
    if unsafe == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        default.symlink_to(tmp_path / "elsewhere")
    elif unsafe == "file":
        default.write_text("")
    else:
        default.mkdir()
        default.chmod(0o770 if unsafe == "group-writable" else 0o777)
    with caplog.at_level(logging.WARNING, "ftrun.agent"):
        assert prepare_compile_caches(environ) == {CACHE_VARIABLE: str(private_cache_dir(environ))}
    assert private_cache_dir(environ).stat().st_mode & 0o777 == 0o700
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"torch.compile caches in {private_cache_dir(environ)}"
    ]


def test_both_unsafe_turns_caching_off(environ, caplog):
    for path in (torch_default_cache_dir(environ), private_cache_dir(environ)):
        path.mkdir()
        path.chmod(0o777)
    with caplog.at_level(logging.WARNING, "ftrun.agent"):
        assert prepare_compile_caches(environ) == {DISABLE_VARIABLE: "1"}
    assert "turned off" in caplog.text
