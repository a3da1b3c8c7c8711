"""The docs' option tables are the ones generated from the declarations in options.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.ft_launcher import docs
from ftrun.ft_launcher.command_line import help_text
from ftrun.ft_launcher.nvrx_options import NVRX_OPTIONS
from ftrun.ft_launcher.options import FT_OPTIONS, OPTIONS, TORCHRUN_OPTIONS


def _docs_text() -> str:
    return "".join(path.read_text(encoding="utf-8") for path in docs.documents(docs.ROOT))


def test_docs_tables_match_the_option_declarations() -> None:
    current = {path: path.read_text(encoding="utf-8") for path in docs.documents(docs.ROOT)}
    wanted = docs.render_all(current)
    stale = [path.name for path in current if wanted[path] != current[path]]
    assert stale == [], f"out of date: run {docs.COMMAND}"


def test_each_table_lives_on_its_topic_page() -> None:
    homes = {name: [] for name in docs.BLOCKS}
    for path in docs.documents(docs.ROOT):
        for name in docs.render(path.read_text(encoding="utf-8"))[1]:
            homes[name].append(path.name)
    assert homes == {
        "ft-options": ["options.md"],
        "torchrun-options": ["options.md"],
        "nvrx-options": ["migrating-from-nvrx.md"],
        "worker-env": ["workers.md"],
    }


def test_every_option_is_in_the_docs_with_its_help() -> None:
    text = _docs_text()
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
        "outro\n"
    )
    fresh, found = docs.render(stale)
    assert found == {"ft-options", "torchrun-options"}
    assert fresh.startswith("intro\n<!-- BEGIN GENERATED: ft-options (anything) -->\n| option |")
    assert "OLD" not in fresh  # not "old": a substring of the *threshold options
    assert "\nmiddle\n" in fresh
    assert fresh.endswith("<!-- END GENERATED: torchrun-options -->\noutro\n")
    assert docs.render(fresh) == (fresh, found)
    with pytest.raises(ValueError, match="unknown generated block 'nope'"):
        docs.render("<!-- BEGIN GENERATED: nope -->\n<!-- END GENERATED: nope -->\n")


def _block(name: str) -> str:
    return f"<!-- BEGIN GENERATED: {name} -->\n<!-- END GENERATED: {name} -->\n"


def test_each_block_must_be_in_exactly_one_file() -> None:
    a, b = Path("a.md"), Path("b.md")
    whole = {a: _block("ft-options") + _block("torchrun-options"),
             b: _block("nvrx-options") + _block("worker-env")}  # fmt: skip
    assert set(docs.render_all(whole)) == {a, b}
    with pytest.raises(ValueError, match="no file has the generated block nvrx-options"):
        docs.render_all({a: whole[a]})
    with pytest.raises(ValueError, match=r"nvrx-options is in a\.md, b\.md"):
        docs.render_all({a: whole[a] + whole[b], b: whole[b]})
    with pytest.raises(ValueError, match=r"b\.md: unknown generated block"):
        docs.render_all({a: whole[a], b: _block("nope")})


def test_cells_are_markdown_safe() -> None:
    assert docs._cell("a|b <node> --x-y=1 and `--z`") == "a\\|b &lt;node&gt; `--x-y=1` and `--z`"


def _copy_docs(root: Path) -> dict[Path, str]:
    """README.md and docs/*.md copied under `root`; their texts by new path."""
    (root / "docs").mkdir()
    texts = {}
    for path in docs.documents(docs.ROOT):
        copy = root / path.relative_to(docs.ROOT)
        texts[copy] = path.read_text(encoding="utf-8")
        copy.write_text(texts[copy], encoding="utf-8")
    return texts


def test_check_mode_reports_a_stale_page(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _copy_docs(tmp_path)
    page = tmp_path / "docs" / "options.md"
    page.write_text(good[page].replace("| `--ft-log-level`", "| `--ft-log-lvl`"), encoding="utf-8")
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert docs.COMMAND in err and "options.md" in err and "README.md" not in err
    assert docs.main([]) == 0
    assert {path: path.read_text(encoding="utf-8") for path in good} == good
    assert docs.main(["--check"]) == 0


def test_a_missing_block_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _copy_docs(tmp_path)
    page = tmp_path / "docs" / "migrating-from-nvrx.md"
    page.write_text(good[page].replace("BEGIN GENERATED: nvrx", "BEGIN: nvrx"), encoding="utf-8")
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert docs.main(["--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nvrx-options" in err
    assert docs.main([]) == 2  # nothing written
    assert page.read_text(encoding="utf-8") != good[page]


def test_the_readme_claims_what_the_torchrun_declarations_say() -> None:
    """"Every torchrun flag" (each is declared: test_cli.py; each in options.md: above) with the
    ways one can go that some declaration takes: honoured, ignored with a warning, refused."""
    readme = (docs.ROOT / "README.md").read_text(encoding="utf-8")
    (claim,) = [part for part in readme.split("\n\n") if "every torchrun flag" in part]
    claim = " ".join(claim.split())
    assert "options.md#torchrun-options" in claim
    assert ("ignored" in claim) == any(opt.ignored for opt in TORCHRUN_OPTIONS)
    assert ("refused" in claim) == any(opt.rejected for opt in TORCHRUN_OPTIONS)
    assert "works" not in claim


def test_help_shows_the_same_descriptions() -> None:
    flat = "".join(help_text().split())  # click wraps lines, also at hyphens
    for opt in OPTIONS:
        assert "".join(opt.description.split()) in flat, opt.name
