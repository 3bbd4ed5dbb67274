"""No import cycles: the module import graph of ``vllm`` and ``real_kv_samples``, built from the
source with ``ast``, has no cycle.

Every import statement counts, also those inside functions (a lazy import that closes a cycle is
still a cycle in the design). ``import a.b`` and ``from a import b`` point at module ``a.b`` when
it exists, else at the package ``a`` whose ``__init__`` defines the name. A package's
``__init__`` importing its own submodules is not a cycle: a submodule's implicit import of its
parent package is not counted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm", "real_kv_samples")


def module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name → source file of every module of ``packages`` under ``root``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The known module ``name`` refers to: itself, else its closest known ancestor."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module → the modules of ``packages`` it imports (anywhere in its source)."""
    modules = module_names(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    if not is_package:
                        anchor.pop()
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles() -> None:
    graph = import_graph(REPO)
    assert len(graph) > 50, "the scan found too few modules; is REPO right?"
    assert find_cycles(graph) == []


def test_finds_a_lazy_cycle_and_ignores_parent_packages(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("A = 1\n\ndef f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from pkg import a\nfrom .. import c\n")
    (pkg / "c.py").write_text("import pkg.sub\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.a", "pkg.c"}
    assert graph["pkg.c"] == {"pkg.sub"}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b"]]


LOWER_LAYERS = ("vllm.kv_quant", "vllm.utils", "vllm.config", "vllm._custom_ops")
"""The layers below the specs (docs/design.md §2.1): none of them imports ``vllm.v1`` or
anything above it, anywhere in its source."""

HIGHER = ("vllm.v1", "vllm.cli", "vllm.accuracy", "vllm.benchmarks", "vllm.distributed")


def _in(name: str, packages: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_lower_layers_never_climb_back_up() -> None:
    graph = import_graph(REPO)
    climbing = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _in(module, LOWER_LAYERS)
        for target in targets
        if _in(target, HIGHER)
    )
    assert climbing == []
    # The codecs are the bottom: vllm.kv_quant imports nothing else of vllm.
    assert (
        sorted(
            f"{module} -> {target}"
            for module, targets in graph.items()
            if _in(module, ("vllm.kv_quant",))
            for target in targets
            if not _in(target, ("vllm.kv_quant",))
        )
        == []
    )
