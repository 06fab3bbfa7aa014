"""Names a function binds only inside rank-0 branches.

`if rank == 0: cfg = load()` binds `cfg` on rank 0 alone: on every other rank the
name does not exist, and code after the branch that every rank runs (a collective,
a save) fails there with NameError (or UnboundLocalError) while rank 0 waits in the
collective. `rank_zero_only_bindings` lists, per scope (a function, or None for the
module), the names whose every binding is inside a rank-0 branch, with the first
such binding.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import parameter_names

Scope = Optional[cst.FunctionDef]


def binding_targets(resolver) -> Iterator[Tuple[cst.CSTNode, str]]:
    """(the binding node, the name) for every name a statement or expression binds."""

    def names(target) -> Iterator[str]:
        if isinstance(target, cst.Name):
            yield target.value
        elif isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                yield from names(el.value)
        elif isinstance(target, cst.StarredElement):
            yield from names(target.value)

    for node in resolver.nodes(cst.Assign):
        for t in node.targets:
            for n in names(t.target):
                yield node, n
    for kind in (cst.AnnAssign, cst.AugAssign):
        for node in resolver.nodes(kind):
            if not isinstance(node, cst.AnnAssign) or node.value is not None:
                for n in names(node.target):
                    yield node, n
    for node in resolver.nodes(cst.For):
        for n in names(node.target):
            yield node, n
    for node in resolver.nodes(cst.WithItem):
        if node.asname is not None:
            for n in names(node.asname.name):
                yield node, n
    for node in resolver.nodes(cst.NamedExpr):
        for n in names(node.target):
            yield node, n
    for kind in (cst.FunctionDef, cst.ClassDef):
        for node in resolver.nodes(kind):
            yield node, node.name.value
    for kind in (cst.Import, cst.ImportFrom):
        for node in resolver.nodes(kind):
            if isinstance(node.names, cst.ImportStar):
                continue
            for alias in node.names:
                bound = alias.asname.name if alias.asname is not None else alias.name
                while isinstance(bound, cst.Attribute):
                    bound = bound.value
                if isinstance(bound, cst.Name):
                    yield node, bound.value
    for node in resolver.nodes(cst.ExceptHandler):
        if node.name is not None and isinstance(node.name.name, cst.Name):
            yield node, node.name.name.value


def rank_zero_only_bindings(resolver, rank_zero_branch) -> Dict[Scope, Dict[str, Tuple[cst.CSTNode, cst.If]]]:
    """scope -> name -> (its first binding, the rank-0 `if` around it), for names whose
    every binding in the scope is inside a rank-0 branch. `rank_zero_branch(node)`
    gives the `if` whose rank-0 side holds `node`, or None."""
    seen: Dict[Scope, Dict[str, List[Tuple[cst.CSTNode, Optional[cst.If]]]]] = {}
    for node, name in binding_targets(resolver):
        scope = resolver.enclosing_function(node)
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            scope = resolver.enclosing_function(node)
        seen.setdefault(scope, {}).setdefault(name, []).append((node, rank_zero_branch(node)))
    out: Dict[Scope, Dict[str, Tuple[cst.CSTNode, cst.If]]] = {}
    for scope, by_name in seen.items():
        params = parameter_names(scope) if scope is not None else set()
        for name, bindings in by_name.items():
            if name in params or any(branch is None for _, branch in bindings):
                continue
            first = min(bindings, key=lambda b: resolver.order(b[0]))
            out.setdefault(scope, {})[name] = first
    return out
