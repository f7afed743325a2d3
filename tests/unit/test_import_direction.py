"""Imports point down (issue 15): each room imports only the rooms below it.

Every module of the package is parsed; each ``import weightstream...`` it makes, at the top,
inside a function or only for type checking (``if TYPE_CHECKING:``: a name used in a signature
is a dependency as much as one called), must start with one of the prefixes its room may
import. docs/architecture.md draws the same table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "weightstream"

BASE = {"weightstream.errors", "weightstream._process"}
# room (module prefix) -> the prefixes it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "weightstream.errors": set(),
    "weightstream._process": set(),
    "weightstream.location": BASE,
    "weightstream.localfs": BASE,
    "weightstream.config": BASE | {"weightstream.localfs", "weightstream.compat.runai_env"},
    "weightstream.compat.runai_env": BASE,
    "weightstream.format": BASE,
    "weightstream.devices": BASE,
    "weightstream.progress": BASE,
    "weightstream.memory": BASE | {"weightstream.localfs"},
    "weightstream.tuning": BASE | {"weightstream.config", "weightstream.memory.align"},
    "weightstream.sources": BASE
    | {"weightstream.location", "weightstream.localfs", "weightstream.config", "weightstream.memory.align"},
    "weightstream.engine": BASE
    | {"weightstream.config", "weightstream.format", "weightstream.memory", "weightstream.sources.base"},
    "weightstream.distributed": BASE
    | {
        "weightstream.config",
        "weightstream.format.ranges",
        "weightstream.memory",
        "weightstream.sources.base",
        "weightstream.engine",
    },
    "weightstream.shard": BASE
    | {
        "weightstream.format",
        "weightstream.location",
        "weightstream.sources.base",
        "weightstream.sources.registry",
    },
    "weightstream.cache": BASE
    | {
        "weightstream.config",
        "weightstream.format",
        "weightstream.localfs",
        "weightstream.location",
        "weightstream.shard",
        "weightstream.sources.base",
        "weightstream.sources.file",
    },
    "weightstream.uri": BASE
    | {"weightstream.config", "weightstream.location", "weightstream.sources.registry"},
    "weightstream.checkpoint": BASE
    | {
        "weightstream.cache",
        "weightstream.config",
        "weightstream.devices",
        "weightstream.shard",
        "weightstream.distributed",
        "weightstream.format",
        "weightstream.location",
        "weightstream.localfs",
        "weightstream.engine.parallel",
        "weightstream.sources.base",
        "weightstream.sources.registry",
        "weightstream.uri",
        "weightstream.pipeline",
        "weightstream.memory.room",
    },
    "weightstream.pipeline": BASE
    | {
        "weightstream.cache",
        "weightstream.config",
        "weightstream.devices",
        "weightstream.shard",
        "weightstream.format",
        "weightstream.engine",
        "weightstream.sources.base",
        "weightstream.sources.flow",
        "weightstream.sources.registry",
        "weightstream.tuning.online",
        "weightstream.distributed",
        "weightstream.memory.room",
    },
}
API = BASE | {
    "weightstream.config",
    "weightstream.devices",
    "weightstream.format",
    "weightstream.memory",
    "weightstream.location",
    "weightstream.uri",
    "weightstream.checkpoint",
    "weightstream.pipeline",
    "weightstream.distributed",
    "weightstream.engine.delivery",
    "weightstream.engine.exchange",
    "weightstream.engine.verify",
    "weightstream.sources.base",
}
for room in ("weightstream._api", "weightstream._modules", "weightstream._safe_open"):
    MAY_IMPORT[room] = API
UPPER = {"weightstream.cli", "weightstream.integrations", "weightstream.compat", "weightstream.tools"}
ALL_BUT = {
    # operator tools and integrations sit on the public API and the rooms it exposes; none of
    # them is imported by the library, and only the CLI and `python -m weightstream` import the CLI
    "weightstream.tools": {"weightstream.cli", "weightstream.integrations", "weightstream.compat"},
    "weightstream.sample": {"weightstream.cli", "weightstream.integrations", "weightstream.compat"},
    "weightstream.integrations": {"weightstream.cli", "weightstream.tools"},
    "weightstream.compat": {"weightstream.cli", "weightstream.tools"},
    "weightstream.cli": set(),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every weightstream import, type-only ones included."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("weightstream")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("weightstream"):
            if node.module == "weightstream":  # "from weightstream import errors": the submodules named
                found += [(node.lineno, f"weightstream.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def room_of(module: str, rooms: dict[str, object]) -> str | None:
    matches = [r for r in rooms if module == r or module.startswith(r + ".")]
    return max(matches, key=len) if matches else None


def under(module: str, prefixes: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_room() -> None:
    rooms = {**MAY_IMPORT, **ALL_BUT}
    unplaced = [
        module_name(p) for p in MODULES if module_name(p) not in ("weightstream", "weightstream.__main__")
    ]
    assert [m for m in unplaced if room_of(m, rooms) is None] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_down(path: Path) -> None:
    me = module_name(path)
    if me in ("weightstream", "weightstream.__main__"):
        return  # the package root resolves its public names lazily; __main__ runs the CLI
    wrong = []
    for line, target in imports(path):
        room = room_of(me, MAY_IMPORT)
        if room is not None:
            ok = under(target, MAY_IMPORT[room] | {room})
        else:
            top = room_of(me, ALL_BUT)
            assert top is not None
            ok = not under(target, ALL_BUT[top] - {top})
        if not ok:
            wrong.append(f"{me}:{line} imports {target}")
    assert wrong == []


def test_the_rules_the_issue_names() -> None:
    """The engine never imports a backend, tuning never imports the engine's callers, nothing
    below the CLI imports it (the table above implies these; said here in so many words)."""
    by_module = {module_name(p): [t for _, t in imports(p)] for p in MODULES}
    for me, targets in by_module.items():
        if me.startswith("weightstream.engine"):
            assert not [
                t
                for t in targets
                if t.startswith("weightstream.sources") and t != "weightstream.sources.base"
            ], me
        if me.startswith("weightstream.tuning"):
            callers = {
                "weightstream.engine",
                "weightstream.checkpoint",
                "weightstream.pipeline",
                "weightstream.distributed",
                *UPPER,
            }
            assert not [t for t in targets if under(t, callers)], me
        if not me.startswith("weightstream.cli") and me != "weightstream.__main__":
            assert not [t for t in targets if under(t, {"weightstream.cli"})], me


def test_no_module_imports_itself_round_a_circle() -> None:
    """No import circle between modules, type-only imports included (the pipeline once took a
    whole checkpoint, and the checkpoint built the pipeline: a circle hidden under
    ``TYPE_CHECKING``). A package's ``__init__`` that imports its own modules is not a circle."""
    names = {module_name(p) for p in MODULES}

    def target(t: str) -> str | None:
        while t and t not in names:
            t = t.rpartition(".")[0]
        return t or None

    edges: dict[str, set[str]] = {}
    for p in MODULES:
        me = module_name(p)
        if me in ("weightstream", "weightstream.__main__"):
            continue
        for _, t in imports(p):
            dest = target(t)
            if dest is None or dest == me or dest == "weightstream" or me.startswith(dest + "."):
                continue  # a module importing its own package's __init__ (names it re-exports)
            edges.setdefault(me, set()).add(dest)
    circles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert circles == []
