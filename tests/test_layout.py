"""The package layout: dependencies point one way, and the worker-side client stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _unit(module: str) -> str:
    """The layout unit of a module: its subpackage (`ftrun.agent`, `ftrun.config`) or a
    top-level module (`ftrun.errors`). No exception: every config lives in `ftrun.config`,
    which imports no package that reads it."""
    return ".".join(module.split(".")[:2])


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every `ftrun` module this file imports, at module level or lazily inside functions;
    imports only for type checkers do not count."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("ftrun.")}


def _unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in (SRC / "ftrun").rglob("*.py"):
        unit = _unit(_module_name(path))
        deps = {_unit(name) for name in _imports(path)} - {"ftrun.errors", unit}
        graph.setdefault(unit, set()).update(deps)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One dependency cycle, if any (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = 1
        stack.append(unit)
        for dep in sorted(graph.get(unit, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (found := visit(unit)):
            return found
    return None


def test_no_import_cycle_between_packages() -> None:
    graph = _unit_graph()
    assert "ftrun.agent" in graph and "ftrun.ft_launcher" in graph  # the scan saw the tree
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_dependencies_point_one_way() -> None:
    graph = _unit_graph()
    assert "ftrun.ft_launcher" not in graph["ftrun.agent"]
    assert "ftrun.agent" not in graph["ftrun.rendezvous"]
    assert "ftrun.agent" not in graph["ftrun.rank_monitor"]
    # The in-process tier: the agent and the ranks' library share only the protocol module.
    assert "ftrun.inprocess" not in graph["ftrun.agent"]
    assert graph["ftrun.inprocess_protocol"] <= {"ftrun.environment"}
    # The tools read event logs; `ftrun straggler` also writes the agents' control file, whose
    # format lives in the straggler config (data only, no agent code).
    tools = graph["ftrun.tools"]
    assert tools <= {"ftrun.eventlog", "ftrun.config"}, tools
    # Every config is data: it reads no package that reads it.
    assert graph["ftrun.config"] <= {"ftrun.identity", "ftrun.inprocess_protocol"}, graph[
        "ftrun.config"
    ]
    # The event log and its readers are a library: the tools and the live view both use it.
    assert graph["ftrun.eventlog"] == set(), graph["ftrun.eventlog"]
    assert "ftrun.tools" not in graph["ftrun.observe"], graph["ftrun.observe"]
    # The store clients know nothing of what the job keeps in the store (`aside`: a generic
    # helper that imports nothing of ftrun's).
    assert graph["ftrun.store"] <= {"ftrun.identity", "ftrun.config", "ftrun.aside"}, graph[
        "ftrun.store"
    ]
    assert graph.get("ftrun.aside", set()) == set(), graph["ftrun.aside"]


def test_the_agent_folder_shows_its_layers() -> None:
    """The agent's folder by layer: the loop (the only part that holds the runtime), the pure
    decisions, the node's services, the fork server, placement, and at the top the few modules
    they share; a newcomer finds a room by its name."""
    agent = SRC / "ftrun" / "agent"
    modules = sorted(p.name for p in agent.glob("*.py"))
    assert len(modules) <= 8, modules
    assert {p.name for p in agent.iterdir() if (p / "__init__.py").exists()} == {
        "decisions", "loop", "node_services", "placement", "prewarm"
    }


def _agent_graph() -> dict[str, set[str]]:
    """The agent's parts (each sub-package, each top module) and what each imports of the
    others."""

    def part(module: str) -> str | None:
        names = module.split(".")
        return names[2] if names[:2] == ["ftrun", "agent"] and len(names) > 2 else None

    graph: dict[str, set[str]] = {}
    for path in (SRC / "ftrun" / "agent").rglob("*.py"):
        here = part(_module_name(path))
        if here is None:
            continue
        deps = {part(name) for name in _imports(path)} - {None, here}
        graph.setdefault(here, set()).update(d for d in deps if d is not None)
    return graph


def test_no_cycle_between_the_agents_parts_and_the_decisions_import_none() -> None:
    graph = _agent_graph()
    assert {"loop", "decisions", "node_services", "prewarm"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert graph["decisions"] == set(), graph["decisions"]  # pure: no effect, no runtime
    holders = {p for p, deps in graph.items() if "loop" in deps}
    assert holders == set(), f"{holders} import the loop (the runtime stays in it)"


def test_the_cycle_check_can_fail() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_client_import_stays_light() -> None:
    """Training processes import the client: no server, no psutil, no torch, no agent."""
    code = (
        "import sys, ftrun.client_lib; "
        "heavy = [m for m in ('torch', 'psutil', 'ftrun.rank_monitor.server', 'ftrun.agent') "
        "if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "", f"imported with the client: {out.stdout.strip()}"


def test_no_function_in_src_is_over_60_lines() -> None:
    long = []
    for path in (SRC / "ftrun").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


SUBSYSTEMS = (
    "ftrun.checkpointing",
    "ftrun.straggler",
    "ftrun.lightning",
    "ftrun.rerun",
    "ftrun.observe",
    "ftrun.tools",
)


def test_the_agent_imports_no_subsystem_and_none_imports_the_agent() -> None:
    """The builder (ft_launcher) hands the agent the subsystems' service factories; the
    subsystems meet the agent only through `ftrun.services`."""
    graph = _unit_graph()
    reached = {d for d in graph["ftrun.agent"] if d.startswith(SUBSYSTEMS)}
    assert not reached, f"ftrun.agent imports {sorted(reached)}"
    for unit, deps in graph.items():
        if unit.startswith((*SUBSYSTEMS, "ftrun.services", "ftrun.peer", "ftrun.rendezvous")):
            assert "ftrun.agent" not in deps, f"{unit} imports ftrun.agent"
    assert graph["ftrun.services"] <= {"ftrun.rank_monitor", "ftrun.rendezvous", "ftrun.config"}
