"""The tests' process harness, which the benches reuse rather than copy: `tests/support.py`
(subreaper, descendants, zombies), `tests/launch.py` (free ports, the tests' whole-job helper)
and `tests/etcd_cluster.py` (a real etcd cluster on 127.0.0.1).

Those modules are top-level ones to pytest (`pythonpath = ["tests"]` in pyproject.toml) and
import each other by those names (`from support import wait_for`). Here they are loaded from
their files under the same names, in that order, with nothing added to `sys.path`: this module
is the one documented place where bench/ reaches into tests/ (bench/README.md). A module that
pytest already imported from the same file is reused, not loaded twice.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from . import ROOT

TESTS = ROOT / "tests"


def _load(name: str) -> ModuleType:
    path = TESTS / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() != path.resolve():
            raise ImportError(f"a module {name!r} other than {path} is already imported")
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the tests' {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: the next one imports it by this name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


support = _load("support")
launch = _load("launch")


def etcd_cluster() -> ModuleType:
    """tests/etcd_cluster.py, loaded on first use: it imports pytest (for its skip)."""
    return _load("etcd_cluster")


become_subreaper = support.become_subreaper
live_descendants = support.live_descendants
reap_zombies = support.reap_zombies
wait_for = support.wait_for
free_port = launch.free_port
start_job = launch.start_job
