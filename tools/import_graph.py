"""Print the room-level import graph of a splitspec checkout, read from the source with `ast`.

A room is a top-level folder whose modules install as `splitspec.<room>` (client, server, shared,
train, netsim, bench, cli, v1 = proto/splitspec/v1). Every `import splitspec.X...` or
`from splitspec.X... import` in a room's .py files, at module level or inside a function, is an
edge room -> X, and so is a relative import that climbs out of its room (`from ...server import x`
in client/daemon/, resolved against the file's package). Nothing is imported or run.

    python tools/import_graph.py [CHECKOUT]      (default: the checkout holding this script)

Output: one line per room, `room -> other rooms (module-level / inside functions)`, the cycles
between rooms, if any, and how many import statements of any module stand inside functions.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOMS = {"client": "client", "server": "server", "shared": "shared", "train": "train", "netsim": "netsim",
         "bench": "bench", "cli": "cli", "proto/splitspec/v1": "v1"}


def imported_rooms(path: Path, package: tuple[str, ...] = ()) -> list[tuple[str, bool]]:
    """(room, at module level) for each splitspec import in the file at `path`; `package` (e.g.
    ("splitspec", "client", "daemon")) resolves its relative imports, which are skipped without it."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level > 0 and len(package) >= node.level:
            base = list(package[:len(package) - node.level + 1])  # level 1: the file's own package
            names = [".".join(base + [node.module])] if node.module else [".".join(base + [a.name]) for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "splitspec" and len(parts) > 1:
                found.append((parts[1], id(node) in top_level))
    return found


def inner_imports(path: Path) -> int:
    """Import statements (of any module) below the top level of the file at `path`."""
    tree = ast.parse(path.read_text(), str(path))
    every = sum(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(tree))
    return every - sum(isinstance(node, (ast.Import, ast.ImportFrom)) for node in tree.body)


def room_files(root: Path) -> dict[str, list[Path]]:
    """room -> its .py files (generated protobuf modules left out)."""
    return {room: [p for p in sorted((root / folder).rglob("*.py")) if "_pb2" not in p.name]
            for folder, room in ROOMS.items() if (root / folder).is_dir()}


def room_graph(root: Path) -> dict[str, dict[str, list[int]]]:
    """room -> other room -> [module-level imports, imports inside functions]."""
    graph: dict[str, dict[str, list[int]]] = {}
    folders = {room: folder for folder, room in ROOMS.items()}
    for room, paths in room_files(root).items():
        edges = graph.setdefault(room, defaultdict(lambda: [0, 0]))
        for path in paths:
            package = ("splitspec", room, *path.relative_to(root / folders[room]).parent.parts)
            for other, top in imported_rooms(path, package):
                if other != room:
                    edges[other][0 if top else 1] += 1
    return graph


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[tuple[str, str]]:
    """Pairs of rooms that import each other (directly or through other rooms)."""
    reach = {room: set(edges) for room, edges in graph.items()}
    changed = True
    while changed:
        changed = False
        for room, seen in reach.items():
            more = set().union(*(reach.get(r, set()) for r in seen)) - seen
            if more:
                seen |= more
                changed = True
    return sorted((a, b) for a in reach for b in reach[a] if a < b and a in reach.get(b, set()))


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    graph = room_graph(root)
    for room, edges in graph.items():
        listed = ", ".join(f"{other} ({top}/{inner})" for other, (top, inner) in sorted(edges.items()))
        print(f"{room:7} -> {listed or '-'}")
    found = cycles(graph)
    print("cycles: " + (", ".join(f"{a} <-> {b}" for a, b in found) if found else "none"))
    print(f"imports inside functions: {sum(inner_imports(p) for ps in room_files(root).values() for p in ps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
