"""The `--ft-cfg-path` YAML file: its `fault_tolerance:` section, wherever it sits (NVRx's and
NeMo's files nest it), read safely; one-line errors for what cannot be used."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import yaml

from ftrun.errors import ConfigError
from ftrun.ft_launcher.options import YAML_KEYS, YAML_SECTION


def load_ft_yaml(path: str) -> dict[str, Any]:
    """The `fault_tolerance:` mapping of a YAML file, wherever it sits; unknown keys are errors."""
    try:
        with open(path, encoding="utf-8") as stream:
            document = yaml.safe_load(stream)
    except OSError as err:
        raise ConfigError(f"--ft-cfg-path {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"--ft-cfg-path {path}: not UTF-8 text ({err.reason})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--ft-cfg-path {path}: bad YAML: {_yaml_problem(err)}") from None
    except RecursionError:
        raise ConfigError(f"--ft-cfg-path {path}: bad YAML: nested too deeply") from None
    found = _find_sections(document)
    if not found:
        raise ConfigError(f"--ft-cfg-path {path}: no '{YAML_SECTION}:' mapping in the file")
    if len(found) > 1:
        where = ", ".join(location for location, _ in found)
        raise ConfigError(f"--ft-cfg-path {path}: several '{YAML_SECTION}:' sections ({where})")
    section = found[0][1] or {}
    for key in section:
        if key not in YAML_KEYS:
            hint = difflib.get_close_matches(str(key), sorted(YAML_KEYS), n=1)
            guess = f" (did you mean {hint[0]}?)" if hint else ""
            raise ConfigError(f"{path}: unknown key {YAML_SECTION}.{key}{guess}")
    return dict(section)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: the problem and where."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def _find_sections(document: Any) -> list[tuple[str, Mapping[str, Any] | None]]:
    """Every `fault_tolerance:` key holding a mapping (or nothing), at any depth, in order."""
    found: list[tuple[str, Mapping[str, Any] | None]] = []
    found_ids: set[int] = set()  # one section reached twice through a YAML alias counts once
    visited: set[int] = set()  # aliases can also make cycles
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        location, node = stack.pop()
        if id(node) in visited or not isinstance(node, (dict, list)):
            continue
        visited.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        children = []
        for key, child in items:
            where = f"{location}[{key}]" if isinstance(node, list) else f"{location}.{key}"
            section = isinstance(node, dict) and key == YAML_SECTION
            if not (section and (child is None or isinstance(child, dict))):
                children.append((where, child))
            elif child is None or id(child) not in found_ids:
                found.append((where.lstrip("."), child))
                found_ids.add(id(child))
        stack.extend(reversed(children))
    return found
