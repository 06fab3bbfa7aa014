"""The program: the entry script and every project module its top-level imports reach.

A project is rarely one file: `train.py` imports `engine` (the loop), `data_setup` (the
loaders), `utils` (the save) and `model_builder` (the classes); a thin entry calls
`train(config)` of a package; a Solver class in `solver.py` owns the model, the optimizer and
the loader. `Program.read` follows the top-level imports of the entry and of every project
module they reach (`import a, b`, `import pkg.mod as m`, `from pkg import mod`, `from mod import
X`, `from mod import *`, relative imports inside a package), each module parsed once; a module
is the project's when `project_imports.locate` finds it as a file (never a library).

`training_steps` lists every `<loss>.backward()` of the program's modules: the sites from which
the rewrite works outward. A step outside the entry is one that converting the entry alone can
never reach (rewrite/link.py takes the whole program in; the pipeline's coverage rule refuses a
"converted" that leaves one behind).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from fsdp2_retrofit.syntax.names import child_nodes, dotted, walk

from . import project_imports

# how many modules a program takes in at the most (a guard against a whole library tree in the project)
MAX_MODULES = 64


@dataclass
class ProjectImport:
    """One name of a top-level import statement that binds a project module or a name of one."""

    local: str  # the name bound in the importing module
    path: str  # the project file it comes from
    obj: Optional[str]  # the name imported from that module (`from mod import obj`), None for the module itself
    star: bool = False  # `from mod import *`


@dataclass
class ModuleFile:
    path: str  # normalised absolute path
    module: cst.Module
    data: bytes
    # top-level statement index -> the project imports it makes
    imports: Dict[int, List[ProjectImport]] = field(default_factory=dict)
    # (line, import, its statement) of the project imports made inside a function or a block
    # (`if __name__ == "__main__": from pkg.train import train`)
    nested: List[Tuple[int, ProjectImport, cst.SimpleStatementLine]] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    """A `<x>.backward()` call of the program: a training step. Its line and code are worked out
    when asked (a refusal names the first step): a program that links never asks, and resolving
    the positions of a whole module costs as much as parsing it."""

    path: str
    module: cst.Module = field(repr=False, compare=False)
    call: cst.Call = field(repr=False, compare=False)

    @property
    def line(self) -> int:
        return MetadataWrapper(self.module, unsafe_skip_copy=True).resolve(PositionProvider)[self.call].start.line

    @property
    def code(self) -> str:
        return self.module.code_for_node(self.call)


@dataclass
class Program:
    entry: str
    files: Dict[str, ModuleFile]  # path -> module, the entry first
    order: List[str]  # the modules other than the entry, each after the modules it imports
    problems: List[str] = field(default_factory=list)  # the project modules it reaches and could not read, and why
    roots: List[str] = field(default_factory=list)  # folders the entry puts on sys.path, as written

    @classmethod
    def read(cls, entry_path: str, module: cst.Module, data: bytes) -> "Program":
        entry = _norm(entry_path)
        files: Dict[str, ModuleFile] = {}
        order: List[str] = []
        program = cls(entry, files, order)
        # Python looks in the entry's folder first (sys.path[0]): a module of a folder without __init__.py
        # imports `from base import X` from there
        program.roots = [os.path.dirname(entry)] + (_sys_path_roots(entry, module) if b"sys.path" in data else [])
        program._visit(entry, module, data, [])
        return program

    def _visit(self, path: str, module: cst.Module, data: bytes, stack: List[str]) -> None:
        here = ModuleFile(path, module, data)
        self.files[path] = here
        reached: List[ProjectImport] = []
        positions: list = []  # resolved once, on the first nested import
        for index, stmt in enumerate(module.body):
            found = list(self._project_imports(path, stmt))
            if found:
                here.imports[index] = found
                reached.extend(found)
            elif not isinstance(stmt, cst.SimpleStatementLine) and b"import" in data:
                for line, inner in _nested_imports(module, stmt, positions):
                    for imp in self._project_imports(path, inner):
                        here.nested.append((line, imp, inner))
                        reached.append(imp)
        for imp in reached:
            if imp.path in self.files or imp.path in stack:
                continue
            if len(self.files) >= MAX_MODULES:
                self.problems.append(f"{imp.path} is one module more than the {MAX_MODULES} the program reads")
                break
            text = project_imports.read(imp.path)
            if text is None:
                continue
            try:
                parsed = project_imports.parse(imp.path, text)
            except (cst.ParserSyntaxError, UnicodeDecodeError, LookupError, SyntaxError):
                self.problems.append(f"{imp.path} does not parse")
                continue
            self._visit(imp.path, parsed, text, stack + [path])
        if path != self.entry:
            self.order.append(path)

    def _locate(self, importer: str, dots: int, module: str):
        """The project file an import names: as Python finds it beside the importer, in its package or
        the project's root, or below a folder the entry adds to sys.path (`sys.path.append("../..")`)."""
        found = project_imports.locate(importer, dots, module)
        if found is not None or dots:
            return found
        for root in self.roots:
            found = project_imports.locate(os.path.join(root, "__root__.py"), 0, module)
            if found is not None:
                return found
        return None

    def _project_imports(self, importer: str, stmt) -> Iterator[ProjectImport]:
        if not isinstance(stmt, cst.SimpleStatementLine):
            return
        for small in stmt.body:
            if isinstance(small, cst.Import):
                for alias in small.names:
                    full = dotted(alias.name)
                    found = self._locate(importer, 0, full)
                    if found is not None:
                        local = dotted(alias.asname.name) if alias.asname is not None else full
                        yield ProjectImport(local, _norm(str(found)), None)
            elif isinstance(small, cst.ImportFrom):
                dots = len(small.relative)
                base = dotted(small.module) if small.module is not None else ""
                found = self._locate(importer, dots, base) if (base or dots) else None
                if isinstance(small.names, cst.ImportStar):
                    if found is not None:
                        yield ProjectImport("*", _norm(str(found)), None, star=True)
                    continue
                for alias in small.names:
                    name = dotted(alias.name)
                    local = dotted(alias.asname.name) if alias.asname is not None else name
                    inner = None
                    if found is None or found.name == "__init__.py":  # `from pkg import mod`
                        inner = self._locate(importer, dots, f"{base}.{name}" if base else name)
                    if inner is not None:
                        yield ProjectImport(local, _norm(str(inner)), None)
                    elif found is not None:
                        yield ProjectImport(local, _norm(str(found)), name)

    @property
    def modules(self) -> List[ModuleFile]:
        """The modules other than the entry, each after the modules it imports."""
        return [self.files[p] for p in self.order]

    def loader_modules(self) -> List[str]:
        """The modules other than the entry a function of which builds a DataLoader."""
        return [path for path, mod in self.files.items()
                if path != self.entry and b"DataLoader" in mod.data and _builds_loader(mod.module)]

    def training_steps(self) -> List[Step]:
        """Every `<x>.backward(...)` of the program's modules outside the entry."""
        out: List[Step] = []
        for path, mod in self.files.items():
            if path == self.entry:
                continue
            if b"backward" not in mod.data:  # `loss.backward ()` is a step too
                continue
            out.extend(_steps(path, mod.module))
        return out


def _builds_loader(module: cst.Module) -> bool:
    """A function of `module` builds a DataLoader (`DataLoader(...)`, `data.DataLoader(...)`): a site the
    data stage edits where it is, in the program linked into one analysis."""
    stack = [(module, False)]  # (node, inside a function); child_nodes, not a libcst visit that rebuilds the nodes
    while stack:
        node, inside = stack.pop()
        if type(node) is cst.FunctionDef:
            inside = True
        elif inside and type(node) is cst.Call:
            func = node.func
            name = func.attr.value if isinstance(func, cst.Attribute) else getattr(func, "value", "")
            if isinstance(name, str) and name.endswith("DataLoader"):
                return True
        stack.extend((child, inside) for child in child_nodes(node))
    return False


def _sys_path_roots(entry: str, module: cst.Module) -> List[str]:
    """The folders the entry's top-level statements add to sys.path with a string literal
    (`sys.path.append("../../")`, `sys.path.insert(0, "src")`), or as the folder of the script or a
    folder above it (`os.path.dirname(os.path.dirname(os.path.abspath(__file__)))`): taken from the
    script's folder, where such a script is run from."""
    here = os.path.dirname(entry)
    roots: List[str] = []
    for stmt in module.body:
        if not (isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr)):
            continue
        call = stmt.body[0].value
        if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
                and call.func.attr.value in ("append", "insert") and dotted(call.func.value) == "sys.path"):
            continue
        arg = call.args[-1].value if call.args else None
        folder = _folder_of(arg, here)
        if folder is not None:
            roots.append(os.path.normpath(folder))
    return roots


def _folder_of(expr, here: str) -> Optional[str]:
    if isinstance(expr, cst.SimpleString):
        value = expr.evaluated_value
        return value if os.path.isabs(value) else os.path.join(here, value)
    if isinstance(expr, cst.Call) and dotted(expr.func) in ("os.path.dirname", "os.path.abspath",
                                                                      "os.path.realpath") and expr.args:
        inner = _folder_of(expr.args[0].value, here)
        if inner is None:
            return None
        return os.path.dirname(inner) if dotted(expr.func) == "os.path.dirname" else inner
    if isinstance(expr, cst.Name) and expr.value == "__file__":
        return os.path.join(here, "__file__")
    if isinstance(expr, cst.Call) and dotted(expr.func) == "os.path.join" and len(expr.args) >= 2:
        inner = _folder_of(expr.args[0].value, here)
        parts = [a.value.evaluated_value for a in expr.args[1:] if isinstance(a.value, cst.SimpleString)]
        if inner is None or len(parts) != len(expr.args) - 1:
            return None
        return os.path.join(inner, *parts)
    return None


def _nested_imports(module: cst.Module, stmt, positions: list) -> Iterator[Tuple[int, cst.SimpleStatementLine]]:
    """(line, statement) of the import statements inside a top-level compound statement."""
    found: List[cst.SimpleStatementLine] = []
    stack = [stmt]  # statements and their blocks only, in source order: an import is never inside an expression
    while stack:  # child_nodes, not a libcst visit: that rebuilds every node it passes
        node = stack.pop()
        if isinstance(node, cst.SimpleStatementLine):
            if any(isinstance(small, (cst.Import, cst.ImportFrom)) for small in node.body):
                found.append(node)
        elif not isinstance(node, (cst.BaseExpression, cst.BaseSmallStatement, cst.Decorator, cst.Parameters)):
            stack.extend(reversed(child_nodes(node)))
    if not found:
        return
    if not positions:
        positions.append(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider))
    for node in found:
        yield positions[0][node].start.line, node


def _steps(path: str, module: cst.Module) -> List[Step]:
    """The module's `<x>.backward(...)` calls, in source order (walk: no libcst visit, which rebuilds
    every node it passes)."""
    return [Step(path, module, node) for node in walk(module)
            if type(node) is cst.Call and type(node.func) is cst.Attribute and node.func.attr.value == "backward"]


def _norm(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def unreached_step(step: Step, shown: str, why: str):
    """The refusal of a training step outside the entry that the rewrite could not take in (FSR970)."""
    from fsdp2_retrofit.report import Refusal

    return Refusal(
        step.line,
        f"the training step `{step.code}` is in {shown}, a module the script reaches, and the rewrite cannot "
        "take that module into its analysis",
        f"{why}; converting the script alone would leave that loop's DataLoader, saves and logging as they are "
        "(every rank on the same batches), so nothing is converted",
        "make the program linkable as the reason says, or run rewrite on the module that holds the loop",
        "FSR970",
        path=shown,
    )
