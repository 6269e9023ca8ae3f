"""The package has no import cycles.

Every module of pagedserve/ is parsed (ast, nothing is imported) and every import statement outside an
`if TYPE_CHECKING:` block is an edge, including imports inside functions: a function-local import that "breaks" a
cycle still ties the two modules together (each needs the other to work), so it counts here; the shared thing
belongs in the module both can import. An edge goes to the module named: `import a.b` and `from a import b` (b a
submodule) -> a.b; `from a.b import name` -> a.b. A package's own `__init__` is not an implied edge of importing
one of its submodules (Python runs it, but a submodule importing a sibling through it is not a design cycle unless
the `__init__` imports something back, which is then an edge of its own).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pagedserve

PACKAGE_DIR = Path(pagedserve.__file__).resolve().parent
ROOT = PACKAGE_DIR.name


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, skipping the bodies of `if TYPE_CHECKING:` (their else branches count)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_edges(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package's modules that `name` imports -> the line of the first such import."""
    is_package = path.name == "__init__.py"
    edges: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in modules:  # `a.b.name` where name is not a module: the module a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.setdefault(target, line)

    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT:
                    add(alias.name, node.lineno)
            continue
        if node.level:  # relative: from the module's package, up level - 1 more
            base = name.split(".")
            base = base if is_package else base[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != ROOT:
            continue
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            add(submodule if submodule in modules else source, node.lineno)
    return edges


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in component:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(steps + [cycle[-1]])


def test_find_cycles_finds_a_cycle_and_ignores_a_dag():
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}, "d": {"a": 1, "c": 1}}) == []


def test_import_edges_count_function_local_imports_and_skip_type_checking(tmp_path):
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from pagedserve.config import EngineConfig\n"
              "def f():\n    from pagedserve.outputs import RequestOutput\n"
              "from . import sampling_params\n")
    probe = tmp_path / "_probe.py"  # parsed as if it were pagedserve/_probe.py
    probe.write_text(source)
    edges = import_edges("pagedserve._probe", probe, package_modules())
    assert set(edges) == {"pagedserve.outputs", "pagedserve.sampling_params"}


def test_package_has_no_import_cycles():
    modules = package_modules()
    graph = {name: import_edges(name, path, modules) for name, path in modules.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (any import outside `if TYPE_CHECKING:` counts, function-local ones too):\n" + \
        "\n".join(describe(c, graph) for c in cycles)
