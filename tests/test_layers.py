"""Who may import whom (docs/architecture.md, "Layers"): contract <- materialize <- serving / rl, the
commands on top, and the operator on the run config alone. Every import counts, the lazy ones inside
functions too (grimp reads them all)."""

from __future__ import annotations

import functools

import grimp
import pytest

# Layer -> the packages it must never import (directly or lazily).
FORBIDDEN: dict[str, set[str]] = {
    "rawmm.contract": {
        "rawmm.config",
        "rawmm.materialize",
        "rawmm.serving",
        "rawmm.rl",
        "rawmm.run",
        "rawmm.commands",
        "rawmm.cli",
    },
    "rawmm.materialize": {"rawmm.serving", "rawmm.rl", "rawmm.run", "rawmm.commands", "rawmm.cli"},
    "rawmm.serving": {"rawmm.rl", "rawmm.run", "rawmm.commands", "rawmm.cli"},
    "rawmm.rl": {"rawmm.serving", "rawmm.run", "rawmm.commands", "rawmm.cli"},
    # The orchestrator and the trainer meet only in the shared directory (rawmm.contract.shared_dir), and
    # offload retention reads it without either (the GC process needs no torch).
    "rawmm.rl.orchestrator": {"rawmm.rl.trainer"},
    "rawmm.rl.trainer": {"rawmm.rl.orchestrator"},
    "rawmm.rl.retention": {"rawmm.rl.trainer", "rawmm.rl.orchestrator"},
    # The run config stays light: the operator and every process read it.
    "rawmm.config": {"rawmm.materialize", "rawmm.serving", "rawmm.rl", "rawmm.run", "rawmm.commands"},
}
# What the operator may import of rawmm: the version and the `rawmm.config` package (the run config, the
# value types it parses with, and the engines' `rawmm serve` command line, built as `rawmm run` builds it).
OPERATOR_MAY_IMPORT = ("rawmm", "rawmm.config")


@functools.cache
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("rawmm", "rawmm_operator", cache_dir=None)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports_of(package: str) -> set[tuple[str, str]]:
    """(importer, imported) for every import made by a module of ``package``."""
    return {
        (module, imported)
        for module in graph().modules
        if within(module, package)
        for imported in graph().find_modules_directly_imported_by(module)
    }


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    illegal = sorted(
        (importer, imported)
        for importer, imported in imports_of(layer)
        if any(within(imported, forbidden) for forbidden in FORBIDDEN[layer])
    )
    assert illegal == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_reaches_nothing_above_it_through_other_modules(layer: str) -> None:
    """Through modules outside every layer too (``rawmm.contract.retention_bounds`` importing ``rawmm.materialize``
    would make ``rawmm.contract`` load it)."""
    chains = {
        forbidden: graph().find_shortest_chain(layer, forbidden, as_packages=True)
        for forbidden in sorted(FORBIDDEN[layer])
    }
    assert {forbidden: chain for forbidden, chain in chains.items() if chain} == {}


def test_the_operator_imports_only_the_run_config_of_rawmm() -> None:
    illegal = sorted(
        (importer, imported)
        for importer, imported in imports_of("rawmm_operator")
        if within(imported, "rawmm")
        and imported != OPERATOR_MAY_IMPORT[0]
        and not within(imported, OPERATOR_MAY_IMPORT[1])
    )
    assert illegal == []


def test_only_the_commands_import_the_operator() -> None:
    importers = {importer for importer, imported in imports_of("rawmm") if within(imported, "rawmm_operator")}
    assert importers and all(within(importer, "rawmm.commands") for importer in importers)


# Inside the operator: the children's builders are pure (no I/O, no reconciler, no status) and the
# catalogue, which declares every child, is iterated by the reconciler alone.
OPERATOR_BUILDERS = ("rawmm_operator.children", "rawmm_operator.pods", "rawmm_operator.objects")
BUILDERS_MAY_IMPORT = (*OPERATOR_BUILDERS, "rawmm_operator.names", "rawmm_operator.spec")
CATALOGUE = "rawmm_operator.catalogue"
CATALOGUE_USERS = ("rawmm_operator.reconcile",)


@pytest.mark.parametrize("builders", OPERATOR_BUILDERS)
def test_the_operators_builders_import_only_primitives_names_and_the_spec(builders: str) -> None:
    illegal = sorted(
        (importer, imported)
        for importer, imported in imports_of(builders)
        if within(imported, "rawmm_operator")
        and not any(within(imported, allowed) for allowed in BUILDERS_MAY_IMPORT)
    )
    assert illegal == []


def test_only_the_reconciler_imports_the_catalogue_within_the_operator() -> None:
    importers = {importer for importer, imported in imports_of("rawmm_operator") if imported == CATALOGUE}
    assert importers == set(CATALOGUE_USERS)


def test_the_operator_has_no_import_cycle() -> None:
    modules = {module for module in graph().modules if within(module, "rawmm_operator")}
    cycles = sorted(
        (importer, imported)
        for importer, imported in imports_of("rawmm_operator")
        if imported in modules and graph().chain_exists(importer=imported, imported=importer)
    )
    assert cycles == []
