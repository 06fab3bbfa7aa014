"""The value a name of a project module holds, read across modules (parsed, never imported).

`from policies import get_wrapper, bfSixteen` in the script, where `policies/__init__.py`
says `from .wrapping import get_wrapper` and `from .mixed_precision import *`: each name
is followed, through the re-exports, to the module that binds it itself (the class
registry has read every such module: model_classes). A top-level `NAME = value` there is
its value; a call of a top-level function of the project is what the function's
`return` gives back, followed by value in that module (analysis/flow.py: a local name to
its assignment).

Only one value is an answer. A name bound more than once (a re-export and an
assignment, two star imports, a binding inside an `if`/`try`), a function whose returns
hand back different values, or a value made from the function's parameters is not
read: `why` says which, and where.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import libcst as cst

from .model_classes import ClassRegistry, _absolute, _dotted, _Namer, _package_of
from .returns import own_returns
from .star_imports import _names_bound_by
from fsdp2_retrofit.syntax.names import walk

_MAX_HOPS = 6  # re-exports followed (script -> policies/__init__.py -> policies/wrapping.py ...)


@dataclass
class Bound:
    """What a project name is bound to: `value` of a top-level `NAME = value`, or the
    top-level `function`, in the module `namer` reads; else `why` it is not known."""

    value: Optional[cst.BaseExpression] = None
    function: Optional[cst.FunctionDef] = None
    namer: Optional[_Namer] = None
    why: str = ""


class ModuleValues:
    """Follows names and calls into the project modules the class registry has read."""

    def __init__(self, registry: ClassRegistry):
        self.registry = registry
        self._flows: Dict[int, object] = {}
        self._visiting: set = set()  # (module, name) star imports being read (a cycle binds nothing more)

    def bound(self, qname: str) -> Optional[Bound]:
        """What `qname` (`policies.get_wrapper`) is bound to, following the re-exports of
        project modules; None when its module is not one the registry read."""
        namespace, _, name = qname.rpartition(".")
        if namespace not in self.registry.top_level or not namespace:
            return None
        for _ in range(_MAX_HOPS):
            sources = self._sources(namespace, name)
            if len(sources) != 1:
                where = self.registry.shown_file(namespace)
                if not sources:
                    return Bound(why=f"`{name}` is not bound at the top level of {where}")
                return Bound(why=f"`{name}` is bound more than once in {where} ({', '.join(s[2] for s in sources)})")
            found, target, _ = sources[0]
            if found is not None:
                return found
            namespace, name = target
        return Bound(why=f"`{qname}` is re-exported more than {_MAX_HOPS} times")

    def _sources(self, namespace: str, name: str) -> List[Tuple[Optional[Bound], Tuple[str, str], str]]:
        """Each statement of module `namespace` that binds `name`: (Bound, ...) for its own
        assignment or def, (None, (module, name), ...) for an import from a project module
        it reads, (Bound(why=...), ...) for anything else; the third item names the line."""
        assigns, namer = self.registry.top_level[namespace]
        module = namer.resolver.module
        package = _package_of(namespace, self.registry.files.get(namespace, ""))
        out = []
        for stmt in module.body:
            line = f"line {namer.resolver.line(stmt)}"
            small = stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ()
            if small and all(isinstance(s, cst.ImportFrom) for s in small):
                for imp in small:
                    out += self._imported(imp, _absolute(imp, package), name, line)
                continue
            if name not in _names_bound_by(stmt):
                continue
            if isinstance(stmt, cst.ClassDef):
                out.append((Bound(why=f"`{name}` is a class", namer=namer), ("", ""), line))
            elif isinstance(stmt, cst.FunctionDef):
                out.append((Bound(function=stmt, namer=namer), ("", ""), line))
            elif len(assigns.get(name, ())) == 1 and assigns[name][0] in small:
                out.append((Bound(value=assigns[name][0].value, namer=namer), ("", ""), line))
            else:
                out.append((Bound(why=f"`{name}` is bound at {self.registry.shown_file(namespace)}:"
                                      f"{namer.resolver.line(stmt)} in a way the analysis does not read"),
                            ("", ""), line))
        return out

    def _imported(self, imp: cst.ImportFrom, source: Optional[str], name: str, line: str) -> list:
        """The source of `name` if `imp` (a top-level `from ... import` of a project module) binds it."""
        known = source in self.registry.top_level
        if isinstance(imp.names, cst.ImportStar):
            # `from .mixed_precision import *`: binds the name when that module does (a
            # star import of a library may bind anything: the name is then not sure)
            if not known:
                return [(Bound(why=f"`{name}` may come from `from {source} import *`, a module the analysis does "
                                   "not read"),
                         ("", ""), line)]
            if name.startswith("_") or (source, name) in self._visiting:
                return []
            self._visiting.add((source, name))
            try:
                return [(None, (source, name), line)] if self._sources(source, name) else []
            finally:
                self._visiting.discard((source, name))
        out = []
        for alias in imp.names:
            if _dotted(alias.asname.name if alias.asname else alias.name) != name:
                continue
            if known:
                out.append((None, (source, _dotted(alias.name)), line))
            else:
                why = (f"`{name}` comes from {source or 'a relative import'}, a module the analysis does not read "
                       "(a library, or one beyond the imports it follows)")
                out.append((Bound(why=why), ("", ""), line))
        return out

    def returned(self, bound: Bound) -> Bound:
        """What a call of `bound.function` hands back: the one value every `return` of it
        holds (followed in its module), not made from its parameters."""
        fn, namer = bound.function, bound.namer
        where = f"{fn.name.value}() ({self.registry.shown_file(namer.namespace)}:{namer.resolver.line(fn)})"
        flow = self._flow(namer)
        returns = own_returns(namer.resolver, fn)
        origins = {id(o): o for r in returns if r.value is not None for o in flow.values(r.value)}
        if not returns or any(r.value is None for r in returns):
            return Bound(why=f"{where} does not return a value on every path")
        if len(origins) != 1:
            return Bound(why=f"{where} can return {len(origins)} different values")
        value = next(iter(origins.values()))
        if not isinstance(value, cst.BaseExpression):
            return Bound(why=f"{where} returns an element of a value the analysis does not read")
        for node in _names_read(value):
            if any(isinstance(o, cst.Param) for o in flow.values(node)):
                return Bound(why=f"what {where} returns is made from its parameter `{node.value}`")
        return Bound(value=value, namer=namer)

    def local_value(self, expr: cst.Name, namer: _Namer) -> Optional[cst.BaseExpression]:
        """The one value a name read in a function of a project module holds (its local
        assignment), or None."""
        origins = self.local_values(expr, namer)
        if len(origins) != 1:
            return None
        value = next(iter(origins))
        return value if isinstance(value, cst.BaseExpression) and value is not expr else None

    def local_values(self, expr: cst.Name, namer: _Namer):
        """Every value the value flow says a name read in a function of a project module may hold."""
        return self._flow(namer).values(expr)

    def _flow(self, namer: _Namer):
        from .site_analysis import SiteAnalysis

        key = id(namer.resolver)
        if key not in self._flows:
            self._flows[key] = SiteAnalysis(namer.resolver.module, namer.resolver, self.registry).flow
        return self._flows[key]


def _names_read(value: cst.CSTNode) -> List[cst.Name]:
    """The names `value` reads (not the keywords of its arguments, nor attribute names)."""
    nodes = walk(value)
    skip = {id(n.keyword) for n in nodes if isinstance(n, cst.Arg) and n.keyword is not None}
    skip |= {id(n.attr) for n in nodes if isinstance(n, cst.Attribute)}
    return [n for n in nodes if isinstance(n, cst.Name) and id(n) not in skip]
