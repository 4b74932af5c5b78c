"""The import graph of the tree: no service imports another, and no files import each other in a circle.

Services talk over gRPC and Redis only; what two of them share lives in `llmserve/`. A cycle
is counted whatever the import's place (module top or inside a function), except under
`if TYPE_CHECKING:`, which never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "tokenizer_svc", "batcher", "gpu_worker")
PACKAGES = (*SERVICES, "llmserve")
GENERATED = ROOT / "llmserve" / "v1"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    files = (p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if GENERATED not in p.parents)
    return {_module_name(p): p for p in files}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _imported(module: str, path: Path, modules: set[str]) -> set[str]:
    """The tree's modules that `module` imports (`from a import b` names a.b where b is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
        source = ".".join(p for p in (base, node.module or "") if p)
        targets.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names)
    return {t for t in targets if t in modules and t != module}


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    return {module: _imported(module, path, set(sources)) for module, path in sources.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_service_imports_another():
    crossing = sorted(f"{module} imports {target}" for module, targets in _graph().items()
                      for target in targets
                      if module.split(".")[0] in SERVICES and target.split(".")[0] in SERVICES
                      and target.split(".")[0] != module.split(".")[0])
    assert crossing == []


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_checks_see_a_cycle_and_a_crossing():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "b": {"a.x"}}
    assert _cycles(graph) == [["a.x", "a.y", "a.z"]]
    assert "gateway.flow" in _graph() and "llmserve.catalog.vocabulary" in _graph()["gpu_worker.engine.constraint"]
