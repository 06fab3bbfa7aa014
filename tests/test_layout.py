"""The layout the README's table describes, kept honest: the packages import each other one
way only, libcst's private API is used in one module (whose use a libcst upgrade is
checked against here), and no class or function grows past the size where it should be split.

Imports are read from the sources with `ast` (those inside functions and under
TYPE_CHECKING count too): a cycle hidden in a function body is still a cycle.
"""
from __future__ import annotations

import ast
import functools
import inspect
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import libcst as cst
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fsdp2_retrofit", "codemods")
# the one module allowed libcst's private API (the code generation state it renders with)
PRIVATE_LIBCST_USER = "fsdp2_retrofit/syntax/names.py"
PRIVATE_LIBCST_METHODS = {"_codegen", "_codegen_impl"}  # CSTNode's code generation, not exported


@functools.lru_cache(maxsize=None)
def _sources() -> Tuple[Tuple[str, Path, ast.Module], ...]:
    """(dotted module name, file, its tree) of every module of the tool."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append((module, path, ast.parse(path.read_text(encoding="utf-8"), str(path))))
    return tuple(found)


def _node(module: str) -> str:
    """The unit a module belongs to: `codemods` as a whole, each subpackage or top-level
    module of fsdp2_retrofit (`fsdp2_retrofit.rewrite`, `fsdp2_retrofit.report`), or the
    package's own __init__ (`fsdp2_retrofit`)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "fsdp2_retrofit" else parts[0]


def _imported(module: str, path: Path, tree: ast.Module) -> Iterator[Tuple[str, int]]:
    """(dotted name, line) of every module of the tool that `tree` imports, anywhere in it."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                yield alias.name, stmt.lineno
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                base = ".".join(package[: len(package) - stmt.level + 1] + ([base] if base else []))
            for alias in stmt.names:  # `from fsdp2_retrofit import files` imports fsdp2_retrofit.files
                yield f"{base}.{alias.name}", stmt.lineno


def _unit_of_import(name: str, units: Set[str]) -> Optional[str]:
    """The unit an imported dotted name lands in; None for a module outside the tool."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    unit = _node(name)
    return unit if unit in units else parts[0]  # `from fsdp2_retrofit import __version__`: the package's own


def import_graph() -> Dict[str, Dict[str, List[str]]]:
    """unit -> {unit it imports: ["path:line", ...]}, between different units."""
    modules = _sources()
    units = {_node(module) for module, _, _ in modules}
    graph: Dict[str, Dict[str, List[str]]] = defaultdict(lambda: defaultdict(list))
    for module, path, tree in modules:
        source = _node(module)
        graph[source]  # every unit is a node, importing or not
        for name, line in _imported(module, path, tree):
            target = _unit_of_import(name, units)
            if target is not None and target != source:
                graph[source][target].append(f"{path.relative_to(ROOT)}:{line}")
    return graph


def cycles(graph: Dict[str, Dict[str, List[str]]]) -> List[List[str]]:
    """The strongly connected components of more than one unit (Tarjan), each in sorted order."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        on_stack.add(unit)
        for other in graph.get(unit, {}):
            if other not in index:
                visit(other)
                low[unit] = min(low[unit], low[other])
            elif other in on_stack:
                low[unit] = min(low[unit], index[other])
        if low[unit] == index[unit]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in sorted(graph):
        if unit not in index:
            visit(unit)
    return found


def test_the_graph_sees_the_units_and_their_imports():
    """The reader itself: it finds the units and an import inside a function (cli's pipeline)."""
    graph = import_graph()
    assert {"codemods", "fsdp2_retrofit.rewrite", "fsdp2_retrofit.check", "fsdp2_retrofit.report",
            "fsdp2_retrofit.pipeline", "fsdp2_retrofit.cli", "fsdp2_retrofit.syntax"} <= set(graph)
    assert "fsdp2_retrofit.pipeline" in graph["fsdp2_retrofit.cli"]  # imported inside rewrite_source
    assert "fsdp2_retrofit.files" in graph["fsdp2_retrofit.cli"]  # `from fsdp2_retrofit import files`
    assert "fsdp2_retrofit.rewrite" in graph["codemods"]
    assert cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_packages():
    """codemods and each subpackage and top-level module of fsdp2_retrofit import each other one
    way only (the pipeline above codemods above rewrite; check above rewrite, report below it)."""
    graph = import_graph()
    said = []
    for component in cycles(graph):
        said.append(" <-> ".join(component))
        for unit in component:
            for other in component:
                if other in graph[unit]:
                    said.append(f"  {unit} -> {other}: {', '.join(graph[unit][other][:3])}")
    assert not said, "import cycles between packages:\n" + "\n".join(said)


# --- libcst's private API -------------------------------------------------------------------


def _private_libcst_uses(path: Path, tree: ast.Module) -> List[str]:
    """What of libcst's private API the module at `path` names: imports of `libcst._...`, and
    calls of a node's code generation (`node._codegen(state)`)."""
    uses = []
    for node in ast.walk(tree):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_LIBCST_METHODS:
            uses.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
        for name in names:
            parts = name.split(".")
            if parts[0] == "libcst" and any(p.startswith("_") for p in parts[1:]):
                uses.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
                break
    return uses


def test_private_libcst_api_is_used_in_one_module_only():
    users = {}
    for _, path, tree in _sources():
        uses = _private_libcst_uses(path, tree)
        if uses:
            users[str(path.relative_to(ROOT))] = uses
    assert set(users) == {PRIVATE_LIBCST_USER}, (
        "libcst's private API outside syntax/names.py (use its public API, or go through names.py):\n"
        + "\n".join(u for path, uses in users.items() if path != PRIVATE_LIBCST_USER for u in uses))


def test_the_private_codegen_state_names_py_relies_on():
    """What syntax/names.py takes from libcst._nodes.internal.CodegenState: a libcst upgrade that
    changes it fails here, by name, before any rendering goes wrong."""
    from libcst._nodes.internal import CodegenState

    # constructed with the module's indent and newline style, by keyword; the rest defaulted
    state = CodegenState(default_indent="  ", default_newline="\r\n")
    assert (state.default_indent, state.default_newline) == ("  ", "\r\n")
    assert state.tokens == []
    state.add_token("x")
    assert state.tokens == ["x"]  # names.py joins `tokens` into the text, and adds to it directly

    # names.py overrides record_syntactic_position (keeping its signature) to skip its bookkeeping
    params = inspect.signature(CodegenState.record_syntactic_position).parameters
    assert [(p.name, p.kind) for p in params.values()] == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("node", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("start_node", inspect.Parameter.KEYWORD_ONLY),
        ("end_node", inspect.Parameter.KEYWORD_ONLY),
    ]

    class Counting(CodegenState):
        recorded = 0

        def record_syntactic_position(self, node, *, start_node=None, end_node=None):
            Counting.recorded += 1
            return super().record_syntactic_position(node, start_node=start_node, end_node=end_node)

    # a node's _codegen(state) writes its whole text into the state, asking it to record positions
    module = cst.parse_module("import os\n\n\ndef f(x):\n    return os.path.join(x, 'a')  # c\n")
    counting = Counting(default_indent=module.default_indent, default_newline=module.default_newline)
    module._codegen(counting)
    assert "".join(counting.tokens) == module.code
    assert Counting.recorded > 0  # the override is what codegen calls: skipping it is the saving
    statement = module.body[1]
    counting = Counting(default_indent=module.default_indent, default_newline=module.default_newline)
    statement._codegen(counting)
    assert "".join(counting.tokens) == module.code_for_node(statement)


@pytest.mark.parametrize("text", ["x = 1\n", "", "if a:\n\tb()\r\n", "# only a comment"])
def test_names_render_is_libcsts_code(text):
    """syntax.names.render (through the subclass of CodegenState) writes what libcst writes."""
    from fsdp2_retrofit.syntax.names import render

    module = cst.parse_module(text)
    assert render(module) == module.code
    for stmt in module.body:
        assert render(stmt, module) == module.code_for_node(stmt)


# the size a stage, an analysis or a helper may grow to before it is split along its seams
MAX_CLASS_LINES = 500
MAX_FUNCTION_LINES = 120


def _definitions():
    for path in sorted(list((ROOT / "fsdp2_retrofit").rglob("*.py")) + list((ROOT / "codemods").rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(ROOT), node, node.end_lineno - node.lineno + 1


def test_no_class_or_function_outgrows_its_limit():
    too_long = [
        f"{path}:{node.lineno} {node.name} ({lines} lines)"
        for path, node, lines in _definitions()
        if lines > (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES)
    ]
    assert not too_long, "split along their seams:\n" + "\n".join(too_long)


def test_the_size_check_sees_the_stages():
    names = {node.name for path, node, _ in _definitions() if path.parts[0] == "codemods"}
    assert {"ShardModelCommand", "ConvertLoadsCommand", "RetrofitCommand"} <= names
