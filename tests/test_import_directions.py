"""The import directions of the whole package, read from the source (imports inside
functions included), so that a lazy import cannot hide a loop:

    engine (host side)  imports no jax, runtime, models, attention, sampling, kernels
    pallas_kernels      never imports jaxcb
    jaxcb.native        imports nothing from jaxcb but jaxcb.paths (and itself)
    models              never import runtime, engine, server, llm, offline, bench
    runtime             never imports server, llm, offline, bench, nor an engine class or
                        the factory that builds engines (jaxcb/build.py sits above both)
    offline driver      (offline/driver.py, offline/ordering.py) host side like the engine:
                        no jax, runtime, models, server, bench
    production code     (all of jaxcb but jaxcb.bench) never imports jaxcb.bench: the server
                        owns its HTTP client, the engine the step-trace format
    bench commands      jaxcb/bench/commands/ (the benchmarks) is imported by nothing in
                        jaxcb.bench but itself and the entry point, `python -m jaxcb.bench`
    no cycles           no module reaches itself through imports, lazy ones included (a
                        package's own __init__ excepted: importing jaxcb.x imports jaxcb)
    leaves              config, sampling_params, structured_outputs, outputs, paths,
                        ray_support import no other jaxcb module (but sampling_params its
                        structured_outputs)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxcb", "pallas_kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every absolute module a file imports, at any depth ("from jaxcb import native" counts
    as jaxcb.native)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import (use absolute imports)")
    return found


SOURCES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
GRAPH = {name: imports_of(path) for name, path in SOURCES.items()}


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def offenders(importer: str, forbidden: list[str], allowed: tuple[str, ...] = ()) -> dict:
    """Modules under `importer` that import something under a `forbidden` prefix."""
    bad = {}
    for name, imported in GRAPH.items():
        if not within(name, importer):
            continue
        hits = sorted(
            m
            for m in imported
            if any(within(m, f) for f in forbidden) and not any(within(m, a) for a in allowed)
        )
        if hits:
            bad[name] = hits
    return bad


def jaxcb_modules(*names: str) -> list[str]:
    return [f"jaxcb.{name}" for name in names]


RULES = {
    "engine": (
        "jaxcb.engine",
        [
            "jax",
            "jaxlib",
            "pallas_kernels",
            *jaxcb_modules("runtime", "models", "attention", "sampling", "native"),
            *jaxcb_modules("server", "llm", "bench", "offline"),
        ],
        (),
    ),
    **{
        f"offline.{name}": (
            f"jaxcb.offline.{name}",
            ["jax", "jaxlib", *jaxcb_modules("runtime", "models", "server", "bench")],
            (),
        )
        for name in ("driver", "ordering")
    },
    "pallas_kernels": ("pallas_kernels", ["jaxcb"], ()),
    "native": ("jaxcb.native", ["jaxcb"], ("jaxcb.native", "jaxcb.paths")),
    "models": (
        "jaxcb.models",
        [
            *jaxcb_modules("runtime", "engine", "server", "llm", "offline", "bench"),
            *jaxcb_modules("attention", "sampling"),
        ],
        (),
    ),
    "runtime": (
        "jaxcb.runtime",
        [
            *jaxcb_modules("server", "llm", "offline", "bench", "build"),
            *jaxcb_modules("engine.llm_engine", "engine.replicated"),  # no engine class
        ],
        (),
    ),
    **{
        leaf: (
            f"jaxcb.{leaf}",
            ["jaxcb"],
            ("jaxcb.config", "jaxcb.sampling_params", "jaxcb.structured_outputs"),
        )
        for leaf in (
            "config",
            "sampling_params",
            "structured_outputs",
            "outputs",
            "paths",
            "ray_support",
        )
    },
}


def test_the_package_was_read() -> None:
    assert {"jaxcb.engine.llm_engine", "jaxcb.runtime.setup", "jaxcb.native.build"} <= set(GRAPH)
    assert "pallas_kernels.ragged_paged_attention.tpu" in GRAPH
    # the reader sees imports inside functions
    assert "jaxcb.llm" in GRAPH["jaxcb"]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_import_direction(rule: str) -> None:
    importer, forbidden, allowed = RULES[rule]
    assert offenders(importer, forbidden, allowed) == {}


def test_production_code_never_imports_the_benchmarks() -> None:
    bad = offenders("jaxcb", ["jaxcb.bench"])
    assert {name: hits for name, hits in bad.items() if not within(name, "jaxcb.bench")} == {}


def test_the_benchmark_library_never_imports_the_commands() -> None:
    """jaxcb/bench/commands/ sits on top: only its own modules and the entry point import it."""
    bad = offenders("jaxcb.bench", ["jaxcb.bench.commands"])
    top = ("jaxcb.bench.commands", "jaxcb.bench.__main__")
    assert {name: hits for name, hits in bad.items() if not any(within(name, t) for t in top)} == {}


def _resolve(imported: str) -> str | None:
    """The module of ours an imported name lives in ("jaxcb.models.loading.loader.load_params" ->
    "jaxcb.models.loading.loader"), or None for a third-party one."""
    while imported and imported not in GRAPH:
        imported = imported.rpartition(".")[0]
    return imported or None


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around (Tarjan's strongly
    connected components of more than one module). Edges to an importer's own parent
    packages are left out: `import jaxcb.x` runs jaxcb/__init__.py first by design."""
    edges = {
        name: {
            target
            for target in map(_resolve, imported)
            if target and target != name and not name.startswith(target + ".")
        }
        for name, imported in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles() -> None:
    assert import_cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    graph = {**GRAPH, "jaxcb.paths": GRAPH["jaxcb.paths"] | {"jaxcb.native.build"}}
    assert ["jaxcb.native.build", "jaxcb.paths"] in import_cycles(graph)


def test_the_checker_catches_a_wrong_arrow() -> None:
    """A rule that the code breaks on purpose: runtime does import the engine's types."""
    assert offenders("jaxcb.runtime", ["jaxcb.engine"]) != {}
