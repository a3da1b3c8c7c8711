"""The README's option tables, generated from the declarations in `options.py`.

`python -m ftrun.ft_launcher.docs` rewrites every generated block of README.md (the lines between
`<!-- BEGIN GENERATED: NAME ... -->` and `<!-- END GENERATED: NAME -->`); with `--check` it only
says whether README.md is up to date (exit 1 if not). `tests/test_option_docs.py` fails when the
README and the declarations disagree.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ftrun.ft_launcher.command_line import shown_default
from ftrun.ft_launcher.nvrx_options import NVRX_OPTIONS
from ftrun.ft_launcher.options import FT_OPTIONS, TORCHRUN_OPTIONS, Option

README = Path(__file__).resolve().parents[3] / "README.md"
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
}


def render(text: str) -> str:
    """`text` with every generated block replaced by its current content; every block in
    `BLOCKS` must be there (a `ValueError` names the missing ones)."""
    found: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r}")
        found.add(name)
        return f"{match['begin']}{BLOCKS[name]()}{match['end']}"

    result = _BLOCK.sub(fill, text)
    missing = sorted(set(BLOCKS) - found)
    if missing:
        raise ValueError(f"README has no generated block {', '.join(missing)}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = args == ["--check"]
    if args and not check:
        sys.stderr.write(f"usage: {COMMAND} [--check]\n")
        return 2
    current = README.read_text(encoding="utf-8")
    wanted = render(current)
    if wanted == current:
        return 0
    if check:
        sys.stderr.write(f"{README} is out of date; run: {COMMAND}\n")
        return 1
    README.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
