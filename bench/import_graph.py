"""The import graph of the two packages, read with `ast`: every import counts (module level, inside a function,
under `TYPE_CHECKING`), so a deferred import cannot hide a cycle.

A unit is a package (`tuner/_trials/`) or a top-level module (`tuner/session.py`); `lightning_recompute` is one unit.
Prints each unit's lines, the cycles between units (strongly connected components) and the longest chain of
imports from the CLI to the plugin. tests/test_import_graph.py holds the figures to their limits.

    python bench/import_graph.py
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lightning_recompute", "tuner")


def unit_of(module: str) -> str:
    """`tuner._trials.runner` -> `tuner._trials`; `tuner.session` -> `tuner.session`; the plugin is one unit."""
    parts = module.split(".")
    if parts[0] == "lightning_recompute":
        return parts[0]
    return ".".join(parts[:2])


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(module: str, path: Path) -> set[str]:
    """Every module of the two packages that `module` imports, wherever the import statement stands."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            names.add(stem)
            names.update(f"{stem}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] in PACKAGES}


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, int]]:
    """Unit -> the units it imports, and unit -> its lines."""
    found = modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    lines: dict[str, int] = defaultdict(int)
    for module, path in found.items():
        unit = unit_of(module)
        lines[unit] += len(path.read_text().splitlines())
        edges[unit]
        for name in imported(module, path):
            # `from tuner._trials import runner` names a module; `from tuner._trials import run_trial` a name in one.
            target = name if name in found else name.rpartition(".")[0]
            if target in found and unit_of(target) != unit:
                edges[unit].add(unit_of(target))
    return dict(edges), dict(lines)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        on_stack.add(unit)
        for other in edges.get(unit, ()):
            if other not in index:
                visit(other)
                low[unit] = min(low[unit], low[other])
            elif other in on_stack:
                low[unit] = min(low[unit], index[other])
        if low[unit] == index[unit]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for unit in sorted(edges):
        if unit not in index:
            visit(unit)
    return found


def longest_chain(edges: dict[str, set[str]], start: str, end: str) -> list[str]:
    """The longest simple import path from `start` to `end`, counted in units (both ends included)."""
    best: list[str] = []

    def walk(path: list[str]) -> None:
        nonlocal best
        if path[-1] == end:
            if len(path) > len(best):
                best = list(path)
            return
        for other in sorted(edges.get(path[-1], ())):
            if other not in path:
                path.append(other)
                walk(path)
                path.pop()

    walk([start])
    return best


def main() -> None:
    edges, lines = graph()
    by_package: dict[str, int] = defaultdict(int)
    for unit, count in lines.items():
        by_package[unit.split(".")[0]] += count
    for package, count in sorted(by_package.items()):
        print(f"{package:22} {count:6} lines")
    print(f"{'together':22} {sum(by_package.values()):6} lines")
    found = cycles(edges)
    print(f"units {len(edges)}, imports between units {sum(len(v) for v in edges.values())}")
    print(f"cycles: {len(found)}" + "".join(f"\n  {len(c)} units: {' '.join(c)}" for c in found))
    chain = longest_chain(edges, "tuner.cli", "lightning_recompute")
    print(f"longest chain CLI -> plugin: {len(chain)} units: {' -> '.join(chain)}")


if __name__ == "__main__":
    main()
