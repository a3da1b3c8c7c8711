"""The code blocks of README.md and docs/, and the cheap checks of what they show.

A fenced block names its language; a word after it (GitHub shows none of it) asks for more:

- `python`: compiled; each import resolves (the module's file is found and binds the name,
  read, not run); every name it uses is bound in it, a builtin, or one of `READER_NAMES`, the
  reader's own objects (their model, their data, their step function);
- `python run`: that, and run as the training script of a CPU job under `ft_launcher`
  (tests/test_docs_run.py: what the reader's script has around it, what the job must show);
- `bash`: each command checked by its program's own parser, as far as it goes without a
  cluster (`check_command`); `...` and `$VARIABLE` stand for the reader's values;
- `yaml`: parsed; `text`: output or a picture, not code.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib.machinery
import importlib.util
import re
import shlex
import subprocess
import symtable
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
LANGUAGES = {"python": {"", "run"}, "bash": {""}, "yaml": {""}, "text": {""}}
"""Each language and the marks it may carry."""
READER_NAMES = frozenset({
    "model", "optimizer", "optim", "data", "loader", "batch", "compute", "loss_fn",
    "train_step", "build_model", "load_latest", "save", "step", "steps", "total", "start",
    "first_step", "checkpoint", "state_dict", "ckpt_dir", "client",
})  # fmt: skip
"""What a snippet may leave to the reader's script: their objects, never an import of ours."""
PLACEHOLDERS = {"HEAD": "node0", "SLURM_JOB_ID": "4242"}
"""A value for each `$VARIABLE` the shell blocks show."""
SBATCH_TEMPLATE = ROOT / "slurm" / "ftrun.sbatch"
_OPEN = re.compile(r"^(```|~~~)(\S*)\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """Of the opening fence, 1-based."""
    language: str
    mark: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(path: Path) -> Iterator[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opened = _OPEN.match(lines[i])
        if opened:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == opened[1])
            text = "\n".join(lines[i + 1 : end]) + "\n"
            yield Block(path, i + 1, opened[2], opened[3], text)
            i = end
        i += 1


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in blocks_of(path)]


# ---- python ----------------------------------------------------------------------------------


def free_names(source: str) -> set[str]:
    """Names `source` reads that nothing in it binds and that are not builtins."""
    top = symtable.symtable(source, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    found: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            global_ = sym.is_global() or table.get_type() == "module"
            if sym.is_referenced() and global_ and not (sym.is_assigned() or sym.is_imported()):
                found.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return {name for name in found - bound if not hasattr(builtins, name)}


def _spec(module: str) -> importlib.machinery.ModuleSpec | None:
    """Where `module` is, found as `import` would find it, running none of its code."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)  # a top-level name runs nothing
    for depth in range(len(rest)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        name = ".".join([top, *rest[: depth + 1]])
        spec = importlib.machinery.PathFinder.find_spec(name, spec.submodule_search_locations)
    return spec


@cache
def _binds(origin: str) -> frozenset[str] | None:
    """The names a module's source binds at its top (None: not Python source, anything goes);
    a module with a `__getattr__` (lazy names) binds every string it holds too."""
    if not origin.endswith(".py"):
        return None
    tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
    if "__getattr__" in names:
        names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                     and isinstance(n.value, str))  # fmt: skip
    return frozenset(names)


def has_name(module: str, name: str) -> bool:
    """Whether `from module import name` finds `name` (a binding or a submodule)."""
    spec = _spec(module)
    if spec is None:
        return False
    if spec.submodule_search_locations and _spec(f"{module}.{name}") is not None:
        return True
    names = _binds(spec.origin) if spec.origin else None
    return names is None or name in names


def python_problems(block: Block) -> list[str]:
    """What keeps the block from running as a reader pastes it into their script."""
    try:
        tree = ast.parse(block.text)
    except SyntaxError as err:
        return [f"does not compile: {err}"]
    problems, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _spec(alias.name) is None:
                    problems.append(f"import {alias.name}: no such module")
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            problems += [f"from {node.module} import {a.name}: not found" for a in node.names
                         if not has_name(node.module or "", a.name)]  # fmt: skip
    for node in ast.walk(tree):  # inprocess.Wrapper: the alias's module has it
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module and not has_name(module, node.attr):
                problems.append(f"{module}.{node.attr}: not found")
    unknown = sorted(free_names(block.text) - READER_NAMES)
    if unknown:
        problems.append(f"uses names it does not define or import: {', '.join(unknown)}")
    return problems


# ---- shell -----------------------------------------------------------------------------------


def commands(text: str) -> list[list[str]]:
    """Each command of a shell block as words: lines joined at `\\`, comments and `&` dropped,
    `...` (the reader's other options) left out, `$VARIABLE` replaced by its placeholder."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        valued = re.sub(r"\$\{?(\w+)\}?", lambda m: PLACEHOLDERS[m[1]], line)
        words = [w for w in shlex.split(valued, comments=True) if w not in ("...", "&")]
        if words:
            found.append(words)
    return found


def check_command(words: list[str]) -> None:
    """Raise (AssertionError, ConfigError, click's errors) unless the command is valid."""
    program, args = words[0], words[1:]
    if program == "make":
        phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M)
        assert phony and set(args) <= set(phony[1].split()), f"no make target {args}"
    elif program == "ft_launcher":
        check_launcher(args)
    elif program == "ftrun":
        from ftrun.tools.cli import main

        command = main.commands.get(args[0]) if args else None
        assert command is not None, f"no ftrun subcommand {args[:1]}"
        command.make_context(f"ftrun {args[0]}", list(args[1:]))
    elif program == "sbatch":
        check_sbatch(args)
    elif program == "python" and args[:1] == ["-c"]:
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        out = done.stdout.strip()
        assert not out.startswith("/") or Path(out).exists(), f"{out}: no such file"
    else:
        raise AssertionError(f"no check for the program {program!r}")


def check_launcher(args: list[str]) -> None:
    """The options parsed into a launch config as `ft_launcher` builds it (nothing started)."""
    from ftrun.ft_launcher.build import build_config

    build_config(args, {}, devices=lambda kind: 8)


def check_sbatch(args: list[str]) -> None:
    """`sbatch [SBATCH OPTIONS] slurm/ftrun.sbatch [TEMPLATE OPTIONS] [LAUNCHER OPTIONS] ...`:
    the template is there, takes its options as given, and the launcher the rest."""
    (at,) = [i for i, arg in enumerate(args) if arg.endswith("ftrun.sbatch")]
    assert (ROOT / args[at]).resolve() == SBATCH_TEMPLATE.resolve(), args[at]
    template = re.findall(r"^#\s+(--ft-[a-z-]+)=", SBATCH_TEMPLATE.read_text(), re.M)
    rest = args[at + 1 :]
    while rest and rest[0].split("=")[0] in template:
        rest = rest[1:]
    check_launcher(rest)


def yaml_problems(block: Block) -> list[str]:
    try:
        yaml.safe_load(block.text)
    except yaml.YAMLError as err:
        return [f"not YAML: {err}"]
    return []


# ---- quotes of code ----------------------------------------------------------------------------

QUOTE = re.compile(r"([\w/.-]+\.py):(\d+) in (\w+)")
"""`file.py:LINE in function`, as the launcher's hang lines quote a stack."""
READERS_FILES = frozenset({"train.py"})
"""Files a quote may name that are the reader's, not this repository's (the README's script)."""


def quoted_file(name: str) -> Path | None:
    """The file a quote names: torch's under the installed torch, else the one file of the
    repository by that name (None if not exactly one)."""
    if name.startswith("torch/"):
        spec = importlib.util.find_spec("torch")
        return Path(spec.origin).parent.parent / name if spec and spec.origin else None
    found = [p for p in ROOT.glob(f"**/{Path(name).name}") if ".venv" not in p.parts]
    return found[0] if len(found) == 1 else None


def quote_problem(name: str, line: int, function: str) -> str | None:
    """None if a call inside `function` of `name` starts at `line` (a stack's line is a call)."""
    if name in READERS_FILES:
        return None
    path = quoted_file(name)
    if path is None or not path.exists():
        return f"{name}: no such file (or more than one)"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        in_it = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function
        if in_it and any(isinstance(n, ast.Call) and n.lineno == line for n in ast.walk(node)):
            return None
    return f"{name}:{line} is no call in {function}"
