"""The packages' import graph, every import counted (module level, in a function, under ``TYPE_CHECKING``):
no unit imports one that imports it back, the library imports nothing of the service, and the chain from the
CLI to the library is short. `bench/import_graph.py` prints the figures."""

from __future__ import annotations

import importlib.util

from tests.helpers import REPO

_spec = importlib.util.spec_from_file_location("import_graph", REPO / "bench" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

EDGES, _LINES = import_graph.graph()


def test_no_unit_imports_one_that_imports_it_back() -> None:
    assert import_graph.cycles(EDGES) == []


def test_the_library_imports_nothing_of_the_service() -> None:
    assert EDGES["lightning_recompute"] == set()


def test_the_chain_from_the_cli_to_the_library_is_at_most_8_units() -> None:
    chain = import_graph.longest_chain(EDGES, "tuner.cli", "lightning_recompute")
    assert len(chain) <= 8, " -> ".join(chain)


def test_the_walk_sees_a_deferred_import() -> None:
    # tuner.cli imports tuner._stores only inside functions; a walk of module-level imports would miss it.
    assert "tuner._stores" in EDGES["tuner.cli"]
