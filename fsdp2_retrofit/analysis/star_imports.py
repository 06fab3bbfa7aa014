"""The names a script binds with `from X import *` of its own modules.

`from models import *` binds every public name of the sibling `models.py` (or of
`models/__init__.py`, and through it of the package modules it star-imports in turn):
the classes a script then builds, `Generator(...)`, have no import of their own to
resolve. The sibling files are read (parsed, never imported) and their exports
computed as Python would: `__all__` when it is a literal list of strings, else every
top-level name without a leading underscore; a later binding replaces an earlier one.

What cannot be known is not guessed:

- a star import of a module that is not a file beside the script (a library), one
  nested in an `if`/`try`, or a computed `__all__` may bind any name: a name bound
  before it (in the same file) may be replaced by it;
- a name two star imports (or a star import and the script itself) bind to
  different things depends on the order of statements that may run conditionally,
  or on a file this analysis reads differently from Python.

Such names are *unsure*: they are left unresolved, and the model analysis refuses a
model built from one (naming the star imports, file and line). Every other exported
name joins the script's Resolver table (`Resolver.add_bindings`), so every analysis
sees `Generator` as `models.Generator`, the name the class registry files it under.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import Resolver, _module_bindings, child_nodes, dotted, import_bindings

# how many star imports deep a chain is followed (script -> models/__init__.py -> models/resnet.py)
MAX_DEPTH = 3


@dataclass
class Exports:
    """What `from <file> import *` binds."""

    names: Dict[str, str] = field(default_factory=dict)  # name -> qualified name
    # name -> why it cannot be resolved (two star imports, a conditional binding, ...)
    unsure: Dict[str, str] = field(default_factory=dict)
    # star imports whose names are unknown (a library, a computed __all__): any name not
    # listed above may come from them ("`from torchvision.models import *` (x.py:3)")
    open: List[str] = field(default_factory=list)


@dataclass
class StarNames:
    """The script's star-imported names: resolved, and those left unresolved with why."""

    names: Dict[str, str] = field(default_factory=dict)
    unsure: Dict[str, str] = field(default_factory=dict)
    open: List[str] = field(default_factory=list)
    # names the script binds itself that a later star import may rebind: their own
    # binding is no longer sure either (dropped from the Resolver's table)
    dropped: set = field(default_factory=set)

    def why_unresolved(self, name: str) -> Optional[str]:
        """Why a name the script reads without binding it is not resolved, if a star
        import may bind it; None when no star import concerns it."""
        if name in self.unsure:
            return self.unsure[name]
        if name not in self.names and self.open:
            return f"`{name}` may come from {_either(self.open)}, whose names are not known"
        return None


# what the reader needs from the class registry: parse a file, and file its classes
Parse = Callable[[Path], Optional[Tuple[cst.Module, Resolver]]]
Collect = Callable[[cst.Module, Resolver, str, Path], None]
IsFile = Callable[[Path], bool]


def star_names(module: cst.Module, resolver: Resolver, path: Optional[str], parse: Parse, collect: Collect,
               is_file: IsFile) -> StarNames:
    """The names the script's star imports bind; `collect` files the classes of each
    module reached (under its dotted name, e.g. `models.dla_simple`)."""
    out = StarNames()
    if not any(isinstance(imp.names, cst.ImportStar) for imp in resolver.nodes(cst.ImportFrom)):
        return out
    reader = _Reader(Path(path).resolve().parent if path else None, parse, collect, is_file)
    exports = reader.exports_of_body(module, resolver, package=None, where="", depth=MAX_DEPTH, stars_only=True)
    out.open = exports.open
    out.unsure.update(exports.unsure)
    out.names.update(exports.names)
    for name in sorted(set(exports.names) | set(exports.unsure)):
        if not resolver.binds(name):
            continue
        if name in exports.names and exports.names[name] in resolver.qnames(cst.Name(name)):
            continue  # `import torch` in both: the same thing
        own = [i for i, stmt in enumerate(module.body) if name in _names_bound_by(stmt)]
        out.names.pop(name, None)
        first = module.body[own[0]] if own else None
        if own and own[0] > reader.star_at.get(name, len(module.body)) and not _conditional(first):
            out.unsure.pop(name, None)  # `from models import *`, then `class Generator`: the script's own wins
            continue
        line = f" (line {resolver.line(first)})" if first is not None else ""
        out.unsure[name] = (
            f"`{name}` is bound both by {_either(reader.star_sources.get(name, ['a star import']))} and by the "
            f"script itself{line}, before the star import or only in some cases: which one a call reaches "
            "depends on the order the statements run"
        )
        out.dropped.add(name)
    return out


def _conditional(stmt) -> bool:
    return not isinstance(stmt, (cst.SimpleStatementLine, cst.ClassDef, cst.FunctionDef))


def _names_bound_by(stmt) -> set:
    """The names a top-level statement binds, imports included (star imports aside)."""
    names = set(_module_bindings([stmt]))
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, (cst.Import, cst.ImportFrom)):
                names |= {local for local, _ in import_bindings(small)}
    return names


def _either(sources) -> str:
    sources = [str(s) for s in sources]
    return " or ".join(sources) if len(sources) <= 3 else ", ".join(sources[:3]) + f" (and {len(sources) - 3} more)"


class _Reader:
    def __init__(self, root: Optional[Path], parse: Parse, collect: Collect, is_file: IsFile):
        self.root = root
        self.parse = parse
        self.collect = collect
        self.is_file = is_file
        self.collected: set = set()
        self.cache: Dict[Tuple[str, int], Optional[Exports]] = {}
        self.visiting: set = set()
        # name -> the star imports of the script that bind it (for messages)
        self.star_sources: Dict[str, List[str]] = {}
        self.star_at: Dict[str, int] = {}  # name -> the last top-level statement of the script star-importing it

    # -- finding the module a `from X import ...` names -----------------------

    def locate(self, imp: cst.ImportFrom, package: Optional[str]) -> Optional[Tuple[str, Path]]:
        """(dotted name, file) of the module an import names, when it is a file under
        the script's folder; `package`: the dotted package of the importing file (None
        for the script, which is in no package)."""
        if self.root is None:
            return None
        base = dotted(imp.module).split(".") if imp.module is not None else []
        if imp.relative:
            if not package:
                return None
            parts = package.split(".")
            up = len(imp.relative) - 1
            if up >= len(parts):
                return None
            parts = parts[: len(parts) - up] + base
        else:
            parts = base
        if not parts:
            return None
        for candidate in (self.root.joinpath(*parts).with_suffix(".py"), self.root.joinpath(*parts, "__init__.py")):
            if self.is_file(candidate):
                return ".".join(parts), candidate
        return None

    def parsed(self, name: str, file: Path) -> Optional[Tuple[cst.Module, Resolver]]:
        """The file, parsed, its classes filed in the registry under `name` (once)."""
        found = self.parse(file)
        if found is not None and name not in self.collected:
            self.collected.add(name)
            self.collect(found[0], found[1], name, file)
        return found

    # -- exports --------------------------------------------------------------

    def exports_of_file(self, name: str, file: Path, depth: int) -> Optional[Exports]:
        """What `from <name> import *` binds; None when it cannot be known (the chain is
        deeper than MAX_DEPTH, circular, or the file does not parse)."""
        key = (str(file), depth)
        if key in self.cache:
            return self.cache[key]
        if str(file) in self.visiting or depth <= 0:
            return None
        parsed = self.parsed(name, file)
        if parsed is None:
            return None
        module, resolver = parsed
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        where = self._display(file)
        self.visiting.add(str(file))
        try:
            body = self.exports_of_body(module, resolver, package, where, depth, stars_only=False, namespace=name)
        finally:
            self.visiting.discard(str(file))
        found = self.cache[key] = _restrict_to_all(module, body, where)
        return found

    def _display(self, file: Path) -> str:
        try:
            return file.relative_to(self.root).as_posix() if self.root else str(file)
        except ValueError:
            return str(file)

    def exports_of_body(self, module: cst.Module, resolver: Resolver, package: Optional[str], where: str,
                        depth: int, stars_only: bool, namespace: str = "") -> Exports:
        """The names a module's top level binds, in order (the script's: only those its
        star imports bind, `stars_only`)."""
        out = Exports()
        bound: Dict[str, str] = {}  # name -> what bound it last (for messages)

        def sure(name: str, qualified: str, source: str) -> None:
            out.unsure.pop(name, None)
            out.names[name] = qualified
            bound[name] = source

        def unsure(name: str, why: str, source: str) -> None:
            out.names.pop(name, None)
            out.unsure[name] = why
            bound[name] = source

        for index, stmt in enumerate(module.body):
            conditional = not isinstance(stmt, cst.SimpleStatementLine)
            for imp in _star_imports_in(stmt):
                text = f"`from {'.' * len(imp.relative)}{dotted(imp.module) if imp.module else ''} import *`"
                source = _Source(resolver, imp, where, text)
                target = self.locate(imp, package)
                inner = self.exports_of_file(target[0], target[1], depth - 1) if target else None
                if inner is None:  # any name may be replaced
                    for name in list(out.names):
                        unsure(name, f"`{name}` is bound by {bound[name]} and may be replaced by {source}, "
                                     "whose names are not known", source)
                    out.open.append(source)
                    continue
                if not where:
                    for name in [*inner.names, *inner.unsure]:
                        self.star_sources.setdefault(name, []).append(source)
                        self.star_at[name] = index
                for name, qualified in inner.names.items():
                    if conditional:
                        unsure(name, f"`{name}` comes from {source}, which runs only in some cases", source)
                    elif name in out.names and out.names[name] != qualified:
                        unsure(name, f"`{name}` is bound by both {bound[name]} and {source}", source)
                    elif name in out.unsure:
                        out.unsure[name] += f" and {source}"
                    else:
                        sure(name, qualified, source)
                for name, why in inner.unsure.items():
                    unsure(name, why, source)
                out.open.extend(inner.open)
            if stars_only:
                continue
            source = _Source(resolver, stmt, where)
            for name, qualified in _plain_bindings(stmt, namespace, package, self):
                if not conditional:
                    sure(name, qualified, source)  # the last binding wins
                elif name in out.unsure:
                    out.unsure[name] += f", and in some cases {source}"
                elif out.names.get(name, qualified) != qualified:
                    unsure(name, f"`{name}` is bound by {bound[name]} and, in some cases, at {source}", source)
                else:
                    sure(name, qualified, source)
        return out


class _Source:
    """Where a name is bound, for messages: `from x import *` (line 3), models.py:7.
    The line is looked up only when a message is written (positions cost a walk)."""

    __slots__ = ("resolver", "node", "where", "text", "_rendered")

    def __init__(self, resolver: Resolver, node: cst.CSTNode, where: str, text: str = ""):
        self.resolver, self.node, self.where, self.text, self._rendered = resolver, node, where, text, None

    def __str__(self) -> str:
        if self._rendered is None:
            line = self.resolver.line(self.node)
            if not self.text:
                self._rendered = f"{self.where}:{line}"
            else:
                self._rendered = f"{self.text} ({self.where}:{line})" if self.where else f"{self.text} (line {line})"
        return self._rendered


def _star_imports_in(stmt) -> List[cst.ImportFrom]:
    """The star imports of a top-level statement (outside the functions and classes it holds)."""
    if isinstance(stmt, cst.SimpleStatementLine):
        return [s for s in stmt.body if isinstance(s, cst.ImportFrom) and isinstance(s.names, cst.ImportStar)]
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return []
    return [n for n in _walk_top(stmt) if isinstance(n, cst.ImportFrom) and isinstance(n.names, cst.ImportStar)]


def _plain_bindings(stmt, namespace: str, package: Optional[str], reader: _Reader):
    """(name, qualified name) for each name a top-level statement of a sibling file
    binds other than by a star import (inside an `if`/`try`/`for`/`with` too)."""
    if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
        yield stmt.name.value, f"{namespace}.{stmt.name.value}"
        return
    imports = [n for n in _walk_top(stmt) if isinstance(n, (cst.Import, cst.ImportFrom))]
    imported = set()
    for imp in imports:
        if isinstance(imp, cst.ImportFrom) and isinstance(imp.names, cst.ImportStar):
            continue
        target = reader.locate(imp, package) if isinstance(imp, cst.ImportFrom) else None
        if target is not None:
            reader.parsed(*target)  # a module of the same package: its classes are filed under its name
        for local, full in import_bindings(imp):
            if target is not None:
                full = f"{target[0]}.{full.rsplit('.', 1)[-1]}"
            imported.add(local)
            yield local, full
    for name in _module_bindings([stmt]):
        if name not in imported:
            yield name, f"{namespace}.{name}"


def _walk_top(stmt):
    """The nodes of a top-level statement outside the functions and classes it holds."""
    stack = [stmt]
    while stack:
        node = stack.pop()
        yield node
        if node is not stmt and isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            continue
        stack.extend(child_nodes(node))


def _restrict_to_all(module: cst.Module, found: Exports, where: str) -> Exports:
    """Keep what `__all__` lists (a literal list or tuple of strings, possibly extended
    by `+=` of one); without `__all__`, the names without a leading underscore."""
    listed: Optional[List[str]] = None
    computed = None
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            if "__all__" in _names_bound_nested(stmt):
                computed = stmt
            continue
        for small in stmt.body:
            target = None
            if isinstance(small, (cst.Assign,)) and any(
                    isinstance(t.target, cst.Name) and t.target.value == "__all__" for t in small.targets):
                target, extend = small.value, False
            elif isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name) \
                    and small.target.value == "__all__":
                target, extend = small.value, True
            elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) \
                    and isinstance(small.value.func, cst.Attribute) \
                    and isinstance(small.value.func.value, cst.Name) and small.value.func.value.value == "__all__":
                computed = small
                continue
            else:
                continue
            strings = _literal_strings(target)
            if strings is None:
                computed = small
            elif extend and listed is not None:
                listed = listed + strings
            else:
                listed = strings
    if computed is not None:
        return Exports(open=[f"the computed `__all__` of {where}"])
    if listed is None:
        return Exports(
            names={n: q for n, q in found.names.items() if not n.startswith("_")},
            unsure={n: w for n, w in found.unsure.items() if not n.startswith("_")},
            open=list(found.open),
        )
    keep = set(listed)
    return Exports(
        names={n: q for n, q in found.names.items() if n in keep},
        unsure={n: w for n, w in found.unsure.items() if n in keep},
        # a listed name the file binds only through an unknown star import is unknown
        open=list(found.open) if any(n not in found.names and n not in found.unsure for n in keep) else [],
    )


def _names_bound_nested(stmt) -> set:
    return set(_module_bindings([stmt]))


def _literal_strings(node) -> Optional[List[str]]:
    if not isinstance(node, (cst.List, cst.Tuple)):
        return None
    out = []
    for element in node.elements:
        if not isinstance(element.value, cst.SimpleString):
            return None
        out.append(element.value.evaluated_value)
    return out
