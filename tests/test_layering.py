"""Import layering: who may import whom (static, every import statement, function-level ones included).

Layers, lowest first; a module may import its own layer or lower ones only:
  0 foundation   rlctl.recipes.{base,errors,calibration} and the run-directory contract
                 rlctl.orchestrator.exchange (it imports nothing else of rlctl)
  1 components   trainer/, inference/, orchestrator/ libraries, and every package's `config` module
                 (the section of the recipe schema that component owns)
  2 recipes      schema composition, loading, planner composition, catalogs
  3 entry points the component processes: `python -m rlctl.{trainer,inference,orchestrator}`
  4 launchers    Slurm and local process management
  5 cli          the Typer app
Within a layer, the graph of packages must have no cycle either, and no module-level cycle exists
anywhere. The trainer reaches the orchestrator only through the exchange.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"cli": "rlctl.cli", "launchers": "rlctl.launchers", "trainer": "rlctl.trainer",
           "inference": "rlctl.inference", "orchestrator": "rlctl.orchestrator", "recipes": "rlctl.recipes"}
FOUNDATION = {"rlctl.recipes.base", "rlctl.recipes.errors", "rlctl.recipes.calibration"}
EXCHANGE = "rlctl.orchestrator.exchange"
ENTRY_POINTS = {"rlctl.trainer.__main__", "rlctl.trainer.train", "rlctl.inference.__main__",
                "rlctl.orchestrator.__main__", "rlctl.inference.pool_service"}
COMPONENTS = ("rlctl.trainer", "rlctl.inference", "rlctl.orchestrator")
LAYER_NAMES = ["foundation", "components", "recipes", "entry points", "launchers", "cli"]


def all_modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def layer(module: str) -> int:
    if module in FOUNDATION or module == EXCHANGE or module.startswith(EXCHANGE + "."):
        return 0
    if module in ENTRY_POINTS:
        return 3
    if module.endswith(".config") or module.startswith(COMPONENTS):
        return 1
    if module.startswith("rlctl.recipes"):
        return 2
    return 4 if module.startswith("rlctl.launchers") else 5


def package(module: str) -> str:
    """The node of the package graph: the top-level package, with the exchange as a node of its own."""
    if module == EXCHANGE or module.startswith(EXCHANGE + "."):
        return EXCHANGE
    return ".".join(module.split(".")[:2])


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` (a module or a name inside one) refers to."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def import_graph() -> dict[str, set[str]]:
    known = all_modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{alias.name}" for alias in node.names] or [base]
            for name in names:
                target = resolve(name, known)
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_go_down_the_layers_only():
    wrong = [f"{m} ({LAYER_NAMES[layer(m)]}) imports {t} ({LAYER_NAMES[layer(t)]})"
             for m, targets in import_graph().items() for t in sorted(targets) if layer(t) > layer(m)]
    assert not wrong, "\n".join(wrong)


def test_components_never_import_the_launchers():
    wrong = [f"{m} imports {t}" for m, targets in import_graph().items() if m.startswith(COMPONENTS)
             for t in targets if t.startswith("rlctl.launchers")]
    assert not wrong, "\n".join(wrong)


def test_the_exchange_depends_on_nothing_but_the_foundation():
    wrong = [f"{m} imports {t}" for m, targets in import_graph().items() if package(m) == EXCHANGE
             for t in targets if layer(t) != 0]
    assert not wrong, "\n".join(wrong)


def test_the_trainer_reaches_the_orchestrator_only_through_the_exchange():
    wrong = [f"{m} imports {t}" for m, targets in import_graph().items() if m.startswith("rlctl.trainer")
             for t in targets if t.startswith("rlctl.orchestrator") and package(t) != EXCHANGE]
    assert not wrong, "\n".join(wrong)


def test_no_module_level_import_cycle():
    assert cycles(import_graph()) == []


def test_no_package_level_cycle_within_a_layer():
    graph = import_graph()
    for level in range(len(LAYER_NAMES)):
        packages: dict[str, set[str]] = {}
        for m, targets in graph.items():
            if layer(m) != level:
                continue
            packages.setdefault(package(m), set())
            packages[package(m)] |= {package(t) for t in targets if layer(t) == level and package(t) != package(m)}
        assert cycles(packages) == [], f"package cycle among the {LAYER_NAMES[level]}"


def test_the_checker_sees_a_planted_cycle():
    """The cycle finder is not vacuous: a planted two-package cycle is reported."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert layer("rlctl.orchestrator.exchange.steps") == 0 and layer("rlctl.launchers.local") == 4
