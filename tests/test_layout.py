"""The package's folders are its architecture: imports only point down the layers, and no modules (nor packages)
import in a circle.

cli | app -> api -> report -> engine | run | probe | advise -> step_copy -> tracing -> model, recipe -> profiles,
local_gpu, hub, extras -> units, errors, files, profile_cache, validation, request.
engine, run, probe and advise sit side by side and do not import each other. The web app is a skin of its own over
the library: it imports nothing of the command line's, and not click, and the command line nothing of its (`vram-plan
app` starts it as a process). Every import counts: at the top of a module, inside a function, under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "vram_planner"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Top to bottom; a module belongs to the group whose name is the module or the nearest package above it (the package
# itself, vram_planner/__init__.py, holds only the version and stands alone at the bottom).
LAYERS: list[tuple[str, list[str]]] = [
    ("cli", ["vram_planner.cli", "vram_planner.__main__"]),
    ("app", ["vram_planner.app"]),
    ("api", ["vram_planner.api"]),
    ("report", ["vram_planner.report"]),
    ("entry points", ["vram_planner.engine", "vram_planner.run", "vram_planner.probe", "vram_planner.advise"]),
    # the exact engine's copy: made by tracing, replayed without torch (its events, the cache growth: pure Python)
    ("copy", ["vram_planner.step_copy"]),
    ("tracing", ["vram_planner.tracing"]),
    # a TRL recipe (or TRL's command-line arguments, and the launcher's) read as the request's fields takes the
    # release's defaults, the model's config and TRL's accelerate configs
    ("model", ["vram_planner.model", "vram_planner.allocator", "vram_planner.recipe", "vram_planner.trl_arguments",
               "vram_planner.launcher"]),
    ("data", ["vram_planner.profiles", "vram_planner.local_gpu", "vram_planner.hub", "vram_planner.extras",
              "vram_planner.profile_data"]),
    ("base", ["vram_planner.units", "vram_planner.errors", "vram_planner.files", "vram_planner.profile_cache",
              "vram_planner.validation", "vram_planner.request", "vram_planner.trl_names", "vram_planner"]),
]
# Layers whose groups stand side by side: a group may import only from itself within the layer.
SIDE_BY_SIDE = {"entry points"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def group_of(module: str) -> tuple[int, str] | None:
    """The layer's index (0 is the top) and the group a module belongs to; None when it has no place."""
    best: tuple[int, str] | None = None
    for rank, (_, groups) in enumerate(LAYERS):
        for group in groups:
            inside = module.startswith(group + ".") and group != PACKAGE
            if (module == group or inside) and (best is None or len(group) > len(best[1])):
                best = (rank, group)
    return best


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """The package modules `module` imports, with the line of each import."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
    return sorted(set(found), key=lambda hit: (hit[1], hit[0]))


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = package_modules()
    known = set(modules) | {"vram_planner.profile_data"}
    return {name: [(target, line) for target, line in imports_of(name, path, known) if target != name]
            for name, path in modules.items()}


def layer_problems(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    problems = []
    for module, targets in graph.items():
        source = group_of(module)
        if source is None:
            problems.append(f"{module} has no layer: add it to LAYERS in tests/test_layout.py or move it")
            continue
        for target, line in targets:
            where = f"{module} (line {line}) imports {target}"
            destination = group_of(target)
            if destination is None:
                problems.append(f"{where}, which has no layer")
            elif destination[0] < source[0]:
                problems.append(f"{where}: upward, from {LAYERS[source[0]][0]} to {LAYERS[destination[0]][0]}")
            elif (destination[0] == source[0] and LAYERS[source[0]][0] in SIDE_BY_SIDE
                  and destination[1] != source[1]):
                problems.append(f"{where}: sideways, {source[1]} and {destination[1]} stand side by side")
    return problems


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Each import circle once, as `a -> b -> a` with the line of each import."""
    edges = {module: {target: line for target, line in targets if target in graph} for module, targets in graph.items()}
    found: list[str] = []
    seen: set[frozenset[str]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for target in sorted(edges[node]):
            if target == start:
                members = frozenset(path)
                if members not in seen:
                    seen.add(members)
                    hops = [f"{a} (line {edges[a][b]}) -> {b}" for a, b in zip(path, path[1:] + [start])]
                    found.append("; ".join(hops))
            elif target not in path and target > start:  # each circle is found from its smallest module
                walk(start, target, path + [target])

    for module in sorted(edges):
        walk(module, module, [module])
    return found


def test_every_module_has_a_layer_and_imports_only_downward():
    problems = layer_problems(import_graph())
    assert not problems, "\n".join(problems)


def test_no_modules_import_each_other_in_a_circle():
    circles = cycles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(circles)


def package_of(module: str) -> str:
    """The package a module belongs to: vram_planner.<first part> (the modules at the top are their own)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, list[tuple[str, int]]]) -> dict[str, list[tuple[str, int]]]:
    """The imports between packages, each with the line of one import that makes it."""
    packages: dict[str, dict[str, int]] = {}
    for module, targets in graph.items():
        edges = packages.setdefault(package_of(module), {})
        for target, line in targets:
            if package_of(target) != package_of(module) and package_of(target) != PACKAGE:
                edges.setdefault(package_of(target), line)
    for edges in list(packages.values()):
        for target in edges:
            packages.setdefault(target, {})
    return {package: sorted(edges.items()) for package, edges in packages.items()}


def test_no_packages_import_each_other_in_a_circle():
    circles = cycles(package_graph(import_graph()))
    assert not circles, "import circles between packages:\n" + "\n".join(circles)


def test_the_web_app_imports_neither_the_command_line_nor_click():
    graph = import_graph()
    problems = [f"{module} (line {line}) imports {target}" for module, targets in graph.items()
                if module.startswith("vram_planner.app") for target, line in targets
                if target.startswith("vram_planner.cli")]
    for module, path in package_modules().items():
        if not module.startswith("vram_planner.app"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            problems += [f"{module} (line {node.lineno}) imports {name}" for name in names
                         if name.split(".")[0] == "click"]
    assert not problems, "\n".join(problems)


def test_the_command_line_imports_nothing_of_the_web_app():
    # `vram-plan app` starts `python -m vram_planner.app` in a process of its own: two skins over one library
    graph = import_graph()
    problems = [f"{module} (line {line}) imports {target}" for module, targets in graph.items()
                if module.startswith(("vram_planner.cli", "vram_planner.__main__")) for target, line in targets
                if target.startswith("vram_planner.app")]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_circle_between_packages():
    graph = {"vram_planner.cli.a": [("vram_planner.app.b", 3)], "vram_planner.app.b": [("vram_planner.cli.c", 5)],
             "vram_planner.cli.c": []}
    assert cycles(package_graph(graph)) == ["vram_planner.app (line 5) -> vram_planner.cli; "
                                            "vram_planner.cli (line 3) -> vram_planner.app"]


def defined_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (what `from module import name` can find)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_every_import_from_the_package_names_what_is_there():
    modules = package_modules()
    known = set(modules) | {"vram_planner.profile_data"}  # the profiles/ folder, installed under the package
    missing = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE and not node.level:
                if node.module not in known:
                    missing.append(f"{module} (line {node.lineno}): no module {node.module}")
                    continue
                there = defined_names(modules[node.module]) if node.module in modules else set()
                missing += [f"{module} (line {node.lineno}): {node.module} has no {alias.name}" for alias in node.names
                            if alias.name not in there and f"{node.module}.{alias.name}" not in known]
            elif isinstance(node, ast.Import):
                missing += [f"{module} (line {node.lineno}): no module {alias.name}" for alias in node.names
                            if alias.name.split(".")[0] == PACKAGE and alias.name not in modules]
    assert not missing, "\n".join(missing)


def test_the_checker_sees_an_upward_import_a_sideways_one_and_a_circle():
    graph = {"vram_planner.model.spec": [("vram_planner.cli", 3)], "vram_planner.run.launch": [("vram_planner.engine", 5)],
             "vram_planner.profiles": [("vram_planner.local_gpu", 7)],
             "vram_planner.local_gpu": [("vram_planner.profiles", 9)], "vram_planner.cli": [], "vram_planner.engine": []}
    problems = layer_problems(graph)
    assert any("vram_planner.model.spec (line 3) imports vram_planner.cli: upward" in p for p in problems)
    assert any("vram_planner.run.launch (line 5) imports vram_planner.engine: sideways" in p for p in problems)
    assert cycles(graph) == ["vram_planner.local_gpu (line 9) -> vram_planner.profiles; "
                             "vram_planner.profiles (line 7) -> vram_planner.local_gpu"]
