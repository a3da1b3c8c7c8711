"""The option tables of the docs, generated from the declarations in `options.py`.

`python -m ftrun.ft_launcher.docs` rewrites every generated block (the lines between
`<!-- BEGIN GENERATED: NAME ... -->` and `<!-- END GENERATED: NAME -->`) wherever it lives:
README.md or a page under docs/. Each block of `BLOCKS` must appear exactly once across those
files (one declaration, one table). With `--check` it only says whether they are up to date
(exit 1 if not); a missing, repeated or unknown block is one line and exit 2.
`tests/test_option_docs.py` fails when the docs and the declarations disagree.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ftrun import environment
from ftrun.ft_launcher.command_line import shown_default
from ftrun.ft_launcher.nvrx_options import NVRX_OPTIONS
from ftrun.ft_launcher.options import FT_OPTIONS, TORCHRUN_OPTIONS, Option

ROOT = Path(__file__).resolve().parents[3]
"""The repository: README.md and docs/ are under it."""
COMMAND = "python -m ftrun.ft_launcher.docs"
_BLOCK = re.compile(
    r"(?P<begin><!-- BEGIN GENERATED: (?P<name>[\w-]+)[^\n]*-->\n)"
    r"(?P<body>.*?)"
    r"(?P<end><!-- END GENERATED: (?P=name) -->)",
    re.DOTALL,
)


_FLAG = re.compile(r"(?<![\w`-])(--[a-z][\w-]*(?:=[\w.-]+)?)")


def _cell(text: str) -> str:
    """`text` safe in a table cell: pipes escaped, no HTML, flags as code."""
    text = text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return _FLAG.sub(r"`\1`", text)


def _flags(opt: Option) -> str:
    """Short flags and the dash spellings (the underscore ones are said once, in the prose)."""
    shown = [f for f in (*opt.flags, *opt.off_flags) if not f.startswith("--") or "_" not in f]
    return ", ".join(f"`{flag}`" for flag in shown)


def _default(opt: Option) -> str:
    default = shown_default(opt)
    return f"`{_cell(default)}`" if default else ""


def options_table(options: Sequence[Option], where: str) -> str:
    """A Markdown table of `options`; `where` is "env" or "yaml" (the column between)."""
    heading = "env" if where == "env" else "YAML key"
    rows = [f"| option | {heading} | default | meaning |", "|---|---|---|---|"]
    for opt in options:
        key = opt.env if where == "env" else opt.yaml_key
        place = f"`{key}`" if key else ""
        rows.append(f"| {_flags(opt)} | {place} | {_default(opt)} | {_cell(opt.description)} |")
    return "\n".join(rows) + "\n"


def nvrx_table(options: Sequence[Option]) -> str:
    """The migration table: each NVRx option ftrun refuses, and what to use instead."""
    rows = ["| NVRx option | YAML key | what it did | in ftrun |", "|---|---|---|---|"]
    for opt in options:
        place = f"`{opt.yaml_key}`" if opt.yaml_key else ""
        rows.append(
            f"| `{opt.label}` | {place} | {_cell(opt.help)} | {_cell(opt.rejected or '')} |"
        )
    return "\n".join(rows) + "\n"


BLOCKS: Mapping[str, Callable[[], str]] = {
    "ft-options": lambda: options_table(FT_OPTIONS, "yaml"),
    "torchrun-options": lambda: options_table(TORCHRUN_OPTIONS, "env"),
    "nvrx-options": lambda: nvrx_table(NVRX_OPTIONS),
    "worker-env": environment.table,
}


def render(text: str) -> tuple[str, set[str]]:
    """`text` with every generated block replaced by its current content, and the names of the
    blocks it holds (a `ValueError` names an unknown one)."""
    found: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r}")
        found.add(name)
        return f"{match['begin']}{BLOCKS[name]()}{match['end']}"

    return _BLOCK.sub(fill, text), found


def documents(root: Path) -> list[Path]:
    """The files that may hold generated blocks: README.md and the pages under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render_all(texts: Mapping[Path, str]) -> dict[Path, str]:
    """Each file's text with its blocks filled; every block of `BLOCKS` must be in exactly one
    of them (a `ValueError` names a missing or repeated one, and where)."""
    wanted: dict[Path, str] = {}
    homes: dict[str, list[str]] = {name: [] for name in BLOCKS}
    for path, text in texts.items():
        try:
            wanted[path], found = render(text)
        except ValueError as exc:
            raise ValueError(f"{path.name}: {exc}") from None
        for name in found:
            homes[name].append(path.name)
    missing = sorted(name for name, where in homes.items() if not where)
    if missing:
        raise ValueError(f"no file has the generated block {', '.join(missing)}")
    for name, where in homes.items():
        if len(where) > 1:
            raise ValueError(f"generated block {name} is in {', '.join(where)}: keep one")
    return wanted


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = args == ["--check"]
    if args and not check:
        sys.stderr.write(f"usage: {COMMAND} [--check]\n")
        return 2
    current = {path: path.read_text(encoding="utf-8") for path in documents(ROOT)}
    try:
        wanted = render_all(current)
    except ValueError as exc:
        sys.stderr.write(f"{COMMAND}: {exc}\n")
        return 2
    stale = [path for path in current if wanted[path] != current[path]]
    if check and stale:
        names = ", ".join(str(path) for path in stale)
        sys.stderr.write(f"{names} out of date; run: {COMMAND}\n")
        return 1
    for path in stale:
        path.write_text(wanted[path], encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
