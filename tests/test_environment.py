"""Every `FTRUN_*` variable is named in one place (`ftrun.environment`) and documented there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ftrun.environment import MEANINGS, Env, table

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "ftrun"
_NAME = re.compile(r"FTRUN_[A-Z0-9_]+")


def _names(root: Path) -> dict[str, set[str]]:
    """Each `FTRUN_*` name spelled in code under `root` (a string, or a keyword argument such
    as `env.update(FTRUN_X=...)`), and the files that spell it; prose in docstrings and
    comments does not count."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            elif isinstance(node, ast.keyword) and node.arg:
                name = node.arg
            else:
                continue
            if _NAME.fullmatch(name):
                found.setdefault(name, set()).add(path.relative_to(root).as_posix())
    return found


def test_each_name_is_spelled_only_in_the_table() -> None:
    found = _names(PACKAGE)
    elsewhere = {name: paths - {"environment.py"} for name, paths in found.items()}
    assert {name: paths for name, paths in elsewhere.items() if paths} == {}
    assert set(found) == {member.value for member in Env}


def test_the_check_finds_a_name_spelled_twice(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('"""FTRUN_X in prose."""\nA = "FTRUN_X"\nd = dict(FTRUN_Y=1)\n')
    assert _names(tmp_path) == {"FTRUN_X": {"a.py"}, "FTRUN_Y": {"a.py"}}


def test_every_variable_has_one_name_and_a_meaning() -> None:
    assert len({member.value for member in Env}) == len(Env.__members__)
    assert set(MEANINGS) == set(Env) and all(MEANINGS.values())
    assert all(f"| `{member}` |" in table() for member in Env)
