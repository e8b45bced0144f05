"""The arrows of the house, from the code: no import cycle between modules, none between rooms,
and the pure rooms import nothing downstream of them (read from the source, not from what one
interpreter happened to load)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"spikeguard.workers": "workers", "spikeguard.policies": "policies"}
PACKAGES["spikeguard.supervisor"] = "supervisor"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT)
    dotted = next(d for d, folder in PACKAGES.items() if rel.parts[0] == folder)
    parts = list(rel.with_suffix("").parts[1:])
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([dotted, *parts])


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports at module level (imports inside functions and
    ``if TYPE_CHECKING:`` blocks are deferred and left out)."""
    files = {_module(p): p for folder in PACKAGES.values() for p in (ROOT / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        out: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    out.add(full if full in files else target)
            elif isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
        graph[mod] = {m for m in out if m in files and m != mod}
    return graph


def room(mod: str) -> str:
    """``spikeguard.supervisor.decide.recovery.machine`` -> ``supervisor.decide``."""
    parts = mod.split(".")[1:]
    return ".".join(parts[:2]) if parts[0] == "supervisor" and len(parts) > 1 else parts[0]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_module_imports_itself_back():
    graph = _graph()
    assert len(graph) > 100  # the whole tree was read
    assert _cycle(graph) is None


def test_no_two_rooms_import_each_other():
    rooms: dict[str, set[str]] = {}
    for mod, outs in _graph().items():
        rooms.setdefault(room(mod), set()).update(room(o) for o in outs if room(o) != room(mod))
    assert _cycle(rooms) is None, rooms


DOWNSTREAM = {
    # the pure decisions know nothing of how messages arrive, how effects are carried out, or
    # who reads the journal
    "supervisor.decide": {"supervisor.intake", "supervisor.act", "supervisor.sinks"}
    | {"supervisor.observe", "supervisor.launch", "supervisor.controller", "supervisor.runner"},
    "supervisor.intake": {"supervisor.act", "supervisor.sinks", "supervisor.observe"}
    | {"supervisor.controller", "supervisor.runner"},
    "supervisor.act": {"supervisor.sinks", "supervisor.observe", "supervisor.controller"},
    "supervisor.observe": {"supervisor.sinks", "supervisor.act", "supervisor.controller"},
    "policies": {"supervisor"},
    "workers": {"supervisor", "policies"},
}


def test_no_room_imports_what_is_downstream_of_it():
    wrong = sorted(
        (mod, o)
        for mod, outs in _graph().items()
        for o in outs
        for r, banned in DOWNSTREAM.items()
        if room(mod) == r and any(room(o) == b or room(o).startswith(b + ".") for b in banned)
    )
    assert wrong == []


def test_the_checks_see_an_arrow_that_points_back():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert room("spikeguard.supervisor.decide.recovery.machine") == "supervisor.decide"
    assert room("spikeguard.policies.engine") == "policies"
