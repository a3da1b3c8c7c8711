"""The README's option tables are the ones generated from the declarations in options.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.ft_launcher import docs
from ftrun.ft_launcher.command_line import help_text
from ftrun.ft_launcher.nvrx_options import NVRX_OPTIONS
from ftrun.ft_launcher.options import FT_OPTIONS, OPTIONS, TORCHRUN_OPTIONS


def test_readme_tables_match_the_option_declarations() -> None:
    text = docs.README.read_text(encoding="utf-8")
    assert docs.render(text) == text, f"README.md is out of date: run {docs.COMMAND}"


def test_every_option_is_in_the_readme_with_its_help() -> None:
    text = docs.README.read_text(encoding="utf-8")
    for opt in OPTIONS:
        assert f"| `{opt.label}`" in text or f"`{opt.label}` |" in text, opt.name
        if opt in NVRX_OPTIONS:  # the migration table: what it did, what to use instead
            assert docs._cell(opt.help) in text and docs._cell(opt.rejected or "") in text
        else:
            assert docs._cell(opt.description) in text, opt.name


def test_tables_list_each_group_in_declaration_order() -> None:
    for options, where in ((FT_OPTIONS, "yaml"), (TORCHRUN_OPTIONS, "env")):
        rows = docs.options_table(options, where).splitlines()[2:]
        assert len(rows) == len(options)
        for row, opt in zip(rows, options, strict=True):
            assert row.startswith("| ") and f"`{opt.label}`" in row.split(" | ")[0]


def test_render_replaces_only_the_marked_blocks() -> None:
    stale = (
        "intro\n"
        "<!-- BEGIN GENERATED: ft-options (anything) -->\nOLD\n<!-- END GENERATED: ft-options -->\n"
        "middle\n"
        "<!-- BEGIN GENERATED: torchrun-options -->\n<!-- END GENERATED: torchrun-options -->\n"
        "<!-- BEGIN GENERATED: nvrx-options -->\n<!-- END GENERATED: nvrx-options -->\n"
        "outro\n"
    )
    fresh = docs.render(stale)
    assert fresh.startswith("intro\n<!-- BEGIN GENERATED: ft-options (anything) -->\n| option |")
    assert "OLD" not in fresh  # not "old": a substring of the *threshold options
    assert "\nmiddle\n" in fresh
    assert fresh.endswith("<!-- END GENERATED: nvrx-options -->\noutro\n")
    assert docs.render(fresh) == fresh
    with pytest.raises(ValueError, match="torchrun-options"):
        docs.render("<!-- BEGIN GENERATED: ft-options -->\n<!-- END GENERATED: ft-options -->\n")


def test_cells_are_markdown_safe() -> None:
    assert docs._cell("a|b <node> --x-y=1 and `--z`") == "a\\|b &lt;node&gt; `--x-y=1` and `--z`"


def test_check_mode_reports_a_stale_readme(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    good = docs.README.read_text(encoding="utf-8")
    readme.write_text(good.replace("| `--ft-log-level`", "| `--ft-log-lvl`"), encoding="utf-8")
    monkeypatch.setattr(docs, "README", readme)
    assert docs.main(["--check"]) == 1
    assert docs.COMMAND in capsys.readouterr().err
    assert docs.main([]) == 0
    assert readme.read_text(encoding="utf-8") == good
    assert docs.main(["--check"]) == 0


def test_help_shows_the_same_descriptions() -> None:
    flat = "".join(help_text().split())  # click wraps lines, also at hyphens
    for opt in OPTIONS:
        assert "".join(opt.description.split()) in flat, opt.name
