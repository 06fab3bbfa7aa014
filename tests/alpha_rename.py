"""Alpha-renaming for tests: give every local name of a script another spelling.

A script whose variables are renamed is the same program; the rewrite must treat it
the same way (issue 27: follow values, not names). ``alpha_rename`` prefixes each
variable, parameter, loop, ``with``/``except`` target and comprehension variable with
``s<k>_``, ``k`` numbering the scope that binds it (module, function, comprehension),
so that names which happen to be spelled alike in two scopes (a helper's
``train_loader`` and its caller's) no longer are. ``unrename`` strips the prefixes
again from any text (a rewritten script, a report line): names the rewrite derives
from a user's name (``<name>_sampler``) come back too.

Left as they are: imports, functions, classes, ``self`` / ``cls``, dunder names,
class attributes, and a parameter whose name some call passes as a keyword to a
callee that is not a function of the script (the keyword is the caller's spelling
of the same parameter, and the callee cannot be told apart by name).
"""
from __future__ import annotations

import re
from typing import Dict, Optional

import libcst as cst
from libcst.metadata import (
    Assignment,
    ComprehensionScope,
    FunctionScope,
    GlobalScope,
    MetadataWrapper,
    ScopeProvider,
)

_PREFIX = re.compile(r"\bs\d+_")
_KEEP = {"self", "cls", "_"}  # `_` says "unused": the rewrite may name it


def unrename(text: str) -> str:
    return _PREFIX.sub("", text)


def alpha_rename(source: str) -> str:
    """`source` with every local name spelled ``s<k>_<name>``."""
    wrapper = MetadataWrapper(cst.parse_module(source))
    scopes = [s for s in dict.fromkeys(wrapper.resolve(ScopeProvider).values()) if s is not None]
    functions = {}  # id(FunctionDef) -> {param name: new name}, for keywords at its calls
    by_node: Dict[int, str] = {}  # id(Name) -> new spelling
    by_scope: Dict[int, Dict[str, str]] = {}
    referent: Dict[int, Assignment] = {}
    for scope in scopes:
        for assignment in scope.assignments:
            if type(assignment) is Assignment:
                for access in assignment.references:
                    referent[id(access.node)] = assignment
    unresolved_keywords = set()
    for call in _calls(wrapper.module):
        target = referent.get(id(call.func))
        if target is None or not isinstance(target.node, cst.FunctionDef):
            unresolved_keywords |= {a.keyword.value for a in call.args if a.keyword is not None}
    for index, scope in enumerate(scopes):
        if not isinstance(scope, (FunctionScope, GlobalScope, ComprehensionScope)):
            continue
        names = by_scope.setdefault(id(scope), {})
        params: Dict[str, str] = {}
        for assignment in scope.assignments:
            if type(assignment) is not Assignment:
                continue  # imports, builtins
            node, name = assignment.node, assignment.name
            if not isinstance(node, (cst.Name, cst.Param)) or name in _KEEP or name.startswith("__"):
                continue
            if isinstance(node, cst.Param) and name in unresolved_keywords:
                continue
            new = names.setdefault(name, f"s{index}_{name}")
            if isinstance(node, cst.Param):
                params[name] = new
            by_node[id(node.name if isinstance(node, cst.Param) else node)] = new
            for access in assignment.references:
                by_node[id(access.node)] = new
        if isinstance(scope, FunctionScope) and isinstance(scope.node, cst.FunctionDef):
            functions[id(scope.node)] = params
    renamed = wrapper.module.visit(_Renamer(by_node, referent, functions, wrapper, by_scope))
    return renamed.code


def _calls(module: cst.Module):
    found = []

    class _Collect(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            found.append(node)

    module.visit(_Collect())
    return found


class _Renamer(cst.CSTTransformer):
    def __init__(self, by_node, referent, functions, wrapper, by_scope):
        super().__init__()
        self.by_node = by_node
        self.referent = referent
        self.functions = functions
        self.scopes = wrapper.resolve(ScopeProvider)
        self.by_scope = by_scope

    def _declared(self, node, name: str, outer: bool) -> Optional[str]:
        """The new spelling of a `global` / `nonlocal` name."""
        scope = self.scopes.get(node)
        if scope is None:
            return None
        if not outer:
            scope = scope.globals
        else:
            scope = scope.parent
            while scope is not None and name not in self.by_scope.get(id(scope), {}):
                scope = scope.parent if scope is not scope.parent else None
        return self.by_scope.get(id(scope), {}).get(name) if scope is not None else None

    def leave_Global(self, original, updated):
        return self._declarations(original, updated, outer=False)

    def leave_Nonlocal(self, original, updated):
        return self._declarations(original, updated, outer=True)

    def _declarations(self, original, updated, outer: bool):
        items = []
        for item in updated.names:
            new = self._declared(original, item.name.value, outer)
            items.append(item.with_changes(name=cst.Name(new)) if new else item)
        return updated.with_changes(names=items)

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        new = self.by_node.get(id(original))
        return updated.with_changes(value=new) if new else updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        target = self.referent.get(id(original.func))
        params = self.functions.get(id(target.node)) if target is not None else None
        if not params:
            return updated
        args = [
            a.with_changes(keyword=cst.Name(params[a.keyword.value]))
            if a.keyword is not None and a.keyword.value in params else a
            for a in updated.args
        ]
        return updated.with_changes(args=args)
