"""The layering of the ``sharded`` package, read from its source with ``ast``.

- No cycle among the module-level imports of sharded's modules: a lower layer never
  imports a higher one (the lowest layer exposes hook slots, such as the primitive
  registry in sharded/_registry.py, and the layers above fill them).
- No function-local import of a sharded module: such an import is how a cycle hides
  (the module imports fine, and the lower layer still calls up into the higher one).
  Imports under ``if TYPE_CHECKING:`` are for annotations only and are allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "sharded"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``from X import ...`` names (relative imports too)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.stmt) -> list[str]:
    """The sharded modules an import statement loads. ``from pkg import name`` loads
    the submodule ``pkg.name`` where there is one, else ``pkg`` itself."""
    found = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                found.append(_longest_module(alias.name))
    elif isinstance(node, ast.ImportFrom):
        src = _resolve(module, node)
        if src == PACKAGE or src.startswith(PACKAGE + "."):
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                found.append(sub if sub in MODULES else _longest_module(src))
    return [t for t in found if t and t != module]


def _longest_module(name: str) -> str:
    parts = name.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(module: str, tree: ast.Module):
    """Yield (import statement, is_module_level) for every import of the module,
    skipping ``if TYPE_CHECKING:`` blocks."""
    def visit(body, top: bool):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, top
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from visit(node.orelse, top)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(node.body, False)
            elif isinstance(node, ast.ClassDef):
                yield from visit(node.body, top)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        yield from visit(sub, top)
    yield from visit(tree.body, True)


def _scan():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    local: list[str] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, top in _walk(module, tree):
            targets = _targets(module, node)
            if not targets:
                continue
            if top:
                graph[module].update(targets)
            else:
                rel = path.relative_to(ROOT.parent)
                local.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return graph, local


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each
    with one cycle through it spelled out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_one_cycle(graph, set(c)) for c in comps]


def _one_cycle(graph, comp: set[str]) -> list[str]:
    start = min(comp)
    path, seen = [start], {start}

    def dfs(v):
        for w in sorted(graph[v] & comp):
            if w == start:
                return True
            if w not in seen:
                seen.add(w)
                path.append(w)
                if dfs(w):
                    return True
                path.pop()
        return False

    dfs(start)
    return path + [start]


def test_the_scan_sees_the_package():
    graph, _ = _scan()
    assert "sharded._manual" in graph and "sharded.collectives" in graph
    assert "sharded._torch" in graph["sharded._manual"]


def test_no_import_cycle():
    graph, _ = _scan()
    cycles = _cycles(graph)
    assert not cycles, "module-level import cycles among sharded's modules:\n" + "\n".join(
        "  " + " -> ".join(c) for c in cycles)


def test_no_function_local_import_of_sharded():
    _, local = _scan()
    assert not local, (
        "function-local imports of sharded modules (import at module level; where that "
        "would make a cycle, the lower module exposes a hook the higher one fills):\n"
        + "\n".join("  " + x for x in local))


def test_detects_a_cycle_and_a_local_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    tree = ast.parse("import os\ndef f():\n    from sharded import sync\n"
                     "if TYPE_CHECKING:\n    from sharded.mesh import Mesh\n")
    found = [(type(n).__name__, top) for n, top in _walk("sharded.x", tree)]
    assert found == [("Import", True), ("ImportFrom", False)]


def test_the_registry_holds_each_primitive_once():
    """NOTE [One registry of primitives]: the collectives and the body's random draw
    fill their entries where they are defined; the layers below read them there."""
    import pytest
    import torch

    from sharded import _registry, _torch, collectives as C, plans
    from sharded.random import rewrite

    for op in (C.PVARY, C.UNVARY, C.PSUM, C.PMAX, C.PMIN, C.ALL_GATHER, C.AXIS_BLOCK,
               C.PSUM_SCATTER, C.ALL_TO_ALL, C.PPERMUTE):
        entry = _registry.get(op)
        assert entry.lower is not None and entry.vma is not None and entry.autograd is not None
        assert entry.vmap is not None
    assert _registry.get(C.AXIS_INDEX).autograd is None       # integer: no gradient
    assert rewrite.RNG_LOCAL_OP in _registry.LOWERINGS and rewrite.RNG_LOCAL_OP in _registry.VMA_RULES
    assert _torch.COLLECTIVE_OPS[C.COLLECTIVE_PERMUTE] == "ppermute"
    assert _torch.COLLECTIVE_OPS[torch.ops._c10d_functional.all_reduce.default] == "all_reduce"
    assert C.PSUM not in _torch.COLLECTIVE_OPS      # lowered before the passes see a graph
    assert plans.AXIS_LAYOUT_OP in _registry.EXPAND
    with pytest.raises(ValueError, match="already set"):
        _registry.define(C.PSUM, lower=lambda mesh, x, axes: x)


# Private torch names (a torch upgrade should touch one file): imports from a module
# with a private component, attribute chains on torch through a private name (aten op
# names such as ``torch.ops.aten._unsafe_view`` are public op names, not private API),
# and the private attributes of torch's objects the project reads.
_PRIVATE_ATTRS = {"_schema", "_local_tensor", "_spec", "_overloadname", "_overloadpacket"}


def _private_torch_uses(tree: ast.Module) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(p.startswith("_") for p in node.module.split(".")):
                lines.append(node.lineno)
        elif isinstance(node, ast.Import):
            if any(a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split("."))
                   for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.Attribute):
            if node.attr in _PRIVATE_ATTRS:
                lines.append(node.lineno)
                continue
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch":
                chain = chain[::-1]
                public = chain[:2] == ["ops", "aten"] and len(chain) > 2
                if not public and any(p.startswith("_") and not p.startswith("__") for p in chain):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_private_torch_apis_only_in_the_torch_module():
    found = []
    for name, path in MODULES.items():
        if name == "sharded._torch":
            continue
        for line in _private_torch_uses(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(ROOT.parent)}:{line}")
    assert not found, "private torch APIs outside sharded/_torch.py:\n" + "\n".join(found)


def test_detects_a_private_torch_use():
    code = ("import torch\nfrom torch._ops import OpOverload\nx = torch._C._foo\n"
            "y = op._schema\nz = torch.ops.aten._unsafe_view.default\n")
    assert _private_torch_uses(ast.parse(code)) == [2, 3, 4]
