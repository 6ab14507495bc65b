"""Import contracts of docs/architecture.md, checked on the source so a violation fails `make test`.

Three rules, read from the code with `ast` (no import runs):
- layers: a room imports only the rooms below it (`MAY_IMPORT`, closed transitively: a room may use whatever the rooms
  it may import may use);
- through `__init__`: another room is imported through its package (`from posttrain.train import Runtime`), never a
  submodule (`posttrain.train.step`), so each room's public surface is the curated list in its `__init__`;
- no import cycles between modules, counting imports inside functions too (a late import that dodges a circle is
  still a circle), but not those under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "posttrain"

# The rooms and what each may import directly. `types` (the shared contracts), `usercode` (importing the user's
# modules named by a recipe's `imports:`) and `chat` (the chat template, called in one place) import nothing of ours
# but `types` and are open to every room; `recipes/` is package
# data (YAML, sample files, an example reward module loaded as user code), not a room.
MAY_IMPORT: dict[str, set[str]] = {
    "config": set(),
    "tracking": {"config"},
    "sandbox": set(),
    "data": {"config"},
    "models": {"config"},
    "verify": {"sandbox"},
    "envs": {"verify", "sandbox"},
    "tasks": {"envs", "verify", "data"},
    "rollout": {"models"},
    "train": {"models", "data", "tracking"},
    "schedule": {"tasks", "config"},
    "evaluate": {"rollout", "envs", "tasks", "data", "tracking"},
    "rl": {"rollout", "envs", "tasks", "train", "schedule", "evaluate"},
    "distributed": {"rl", "evaluate", "sandbox"},
    "serve": {"rollout", "models", "envs", "config", "tracking"},
    "demo": {"distributed", "rl", "evaluate", "serve"},
    "cli": {"demo", "distributed", "serve"},
}
SHARED = {"types", "usercode", "chat"}
NOT_ROOMS = {"recipes"}


@cache
def allowed(room: str) -> frozenset[str]:
    """Every room `room` may import: its own list, closed over the lists of the rooms on it."""
    reach = set(MAY_IMPORT.get(room, set()))
    for below in list(reach):
        reach |= allowed(below)
    return frozenset(reach | SHARED)


def _room(path: Path) -> str:
    parts = path.relative_to(SOURCE).parts
    return parts[0].removesuffix(".py") if len(parts) > 1 or parts[0] != "__init__.py" else ""


def _module(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["posttrain", *parts])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, *, top_level_only: bool) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every absolute `posttrain` import, skipping `if TYPE_CHECKING:` blocks
    (and, with `top_level_only`, the bodies of functions: those imports run late, on call)."""
    found: list[tuple[int, str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("posttrain"):
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, []) for a in node.names if a.name.startswith("posttrain"))
        elif top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        children = node.orelse if isinstance(node, ast.If) and _is_type_checking(node) else ast.iter_child_nodes(node)
        for child in children:
            visit(child)

    visit(tree)
    return found


@cache
def _sources() -> tuple[tuple[Path, ast.Module], ...]:
    paths = [path for path in sorted(SOURCE.rglob("*.py")) if path.relative_to(SOURCE).parts[0] not in NOT_ROOMS]
    return tuple((path, ast.parse(path.read_text(), str(path))) for path in paths)


def test_every_room_is_declared():
    rooms = {_room(path) for path, _ in _sources()} - {"", "__main__"} - SHARED
    assert rooms <= set(MAY_IMPORT), f"rooms missing from MAY_IMPORT (and docs/architecture.md): {rooms - set(MAY_IMPORT)}"


def test_imports_go_down_the_layers():
    wrong = []
    for path, tree in _sources():
        room = _room(path)
        if room in ("", "__main__"):
            continue
        if room in SHARED:
            wrong += [f"{path.relative_to(SOURCE.parent)}:{line} ({room}, open to all) imports {module}"
                      for line, module, _ in _imports(tree, top_level_only=False) if module.split(".")[1] not in SHARED]
            continue
        for line, module, _ in _imports(tree, top_level_only=False):
            target = module.split(".")[1] if "." in module else ""
            if target and target != room and target not in allowed(room):
                wrong.append(f"{path.relative_to(SOURCE.parent)}:{line} ({room}) imports {module}")
    assert not wrong, "imports against the layers of docs/architecture.md:\n" + "\n".join(wrong)


def test_other_rooms_are_imported_through_their_init():
    wrong = []
    for path, tree in _sources():
        room = _room(path)
        for line, module, _ in _imports(tree, top_level_only=False):
            parts = module.split(".")
            if len(parts) > 2 and parts[1] != room:
                wrong.append(f"{path.relative_to(SOURCE.parent)}:{line} imports {module}: "
                             f"import from posttrain.{parts[1]} (export the name there)")
    assert not wrong, "imports that reach into another room's submodules:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    modules = {_module(path) for path, _ in _sources()}
    for path, tree in _sources():
        edges = set()
        for _, module, names in _imports(tree, top_level_only=False):
            edges.add(module)
            edges |= {f"{module}.{name}" for name in names if f"{module}.{name}" in modules}
        graph[_module(path)] = {edge for edge in edges if edge in modules and edge != _module(path)}
    # A package's __init__ importing its own submodules is how packages are built; a cycle through it counts only
    # when a submodule imports its own package's __init__ back.
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + ".") or node.startswith(nxt + ".") and nxt not in SHARED:
                continue
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles at import time:\n" + "\n".join(cycles)
