"""Nested functions and the names they read from the function around them.

A def inside another function that reads a name it does not bind (or declares
`nonlocal`) sees the enclosing function's object: when that is a model or an
optimizer, the nested function holds it too (`closure_propagate`, used by the
per-function model and optimizer names of analysis/models.py and optimizers.py),
and a loader it loops over is read there (`functions_reading`, the data stage's
epoch loop). A nested function that rebinds such a model is found by
`nonlocal_rebinds` (the shard stage refuses it).

For `check`: a closure variable counts as sharded when the function around it
sharded the module before defining the nested one. ShardFacts.sites_for climbs
out of nested functions itself; `sharded_here` also reports where the sharding
is in effect.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import child_nodes, parameter_names, walk
from fsdp2_retrofit.syntax.memo import per_node


def sharded_here(
    shards, expr: cst.BaseExpression, at: cst.CSTNode, fsdp2: bool = True, root_sharded: bool = False
) -> Optional[Tuple[str, cst.CSTNode]]:
    """(root, the place its sharding is in effect) when `expr` is a sharded module or
    a part of one at `at` (with `fsdp2`, sharded by fully_shard, not FSDP1; with
    `root_sharded`, the root itself, not only some of its blocks), climbing out of
    nested functions that close over the root without rebinding it."""
    found = shards.part(expr, at)
    if found is None:
        return None
    root, anchor = found[0], at
    while True:
        name = shards.sharded_module(expr, anchor) if anchor is at else (
            root if shards.sites_for(root, anchor) else None
        )
        if name is not None and (not fsdp2 or shards.is_fsdp2(name, anchor)) and (
            not root_sharded or any(site.whole for site in shards.sites_for(name, anchor))
        ):
            return name, anchor
        fn = shards.scope_of(anchor)
        if fn is None or shards._binds(fn, root) or root.startswith("self.") or root in parameter_names(fn):
            return None
        anchor = fn


def _own_nodes(fn: cst.FunctionDef):
    """The nodes of `fn`'s body in its own scope: not inside a nested def, class or
    lambda (of those only the name they bind in `fn`)."""
    stack = list(reversed(child_nodes(fn.body)))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            yield node.name
            continue
        if isinstance(node, cst.Lambda):
            continue
        stack.extend(reversed(child_nodes(node)))


def _target_names(target) -> Set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Tuple, cst.List)):
        return {n for el in target.elements for n in _target_names(el.value)}
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return set()  # `a.b = ...`, `a[i] = ...` bind nothing


# once per function node (syntax/memo.py); the callers get a fresh set to change
_BINDINGS: Dict[int, tuple] = {}
_FREE_READS: Dict[int, tuple] = {}


def local_bindings(fn: cst.FunctionDef) -> Set[str]:
    """The names `fn` binds in its own scope (parameters, assignments, loop, with and
    except targets, imports, nested defs and classes), less those it declares
    `nonlocal` or `global`: a read of any other name reaches an enclosing scope."""
    return set(per_node(_BINDINGS, fn, lambda: frozenset(_local_bindings(fn))))


def _local_bindings(fn: cst.FunctionDef) -> Set[str]:
    bound = set(parameter_names(fn))
    declared: Set[str] = set()
    for node in _own_nodes(fn):
        if isinstance(node, (cst.Nonlocal, cst.Global)):
            declared |= {n.name.value for n in node.names}
        elif isinstance(node, cst.Assign):
            for t in node.targets:
                bound |= _target_names(t.target)
        elif isinstance(node, (cst.AnnAssign, cst.AugAssign)):
            bound |= _target_names(node.target)
        elif isinstance(node, cst.For):
            bound |= _target_names(node.target)
        elif isinstance(node, cst.AsName):
            bound |= _target_names(node.name)
        elif isinstance(node, cst.NamedExpr):
            bound |= _target_names(node.target)
        elif isinstance(node, cst.Del):
            bound |= _target_names(node.target)
        elif isinstance(node, cst.ImportAlias) and node.asname is None:
            bound.add(dotted_root(node.name))
    for node in _own_nodes(fn):
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            bound.add(node.name.value)
    return bound - declared


def dotted_root(name) -> str:
    while isinstance(name, cst.Attribute):
        name = name.value
    return name.value if isinstance(name, cst.Name) else ""


def free_reads(fn: cst.FunctionDef) -> Set[str]:
    """The names `fn` (or a function nested in it) reads that `fn` does not bind:
    closure variables of the function around it, globals or builtins."""
    return set(per_node(_FREE_READS, fn, lambda: frozenset(_free_reads(fn))))


def _free_reads(fn: cst.FunctionDef) -> Set[str]:
    nodes = walk(fn.body)
    not_reads = {id(n.attr) for n in nodes if isinstance(n, cst.Attribute)}
    not_reads |= {id(n.keyword) for n in nodes if isinstance(n, cst.Arg) and n.keyword is not None}
    reads = {n.value for n in nodes if isinstance(n, cst.Name) and id(n) not in not_reads}
    return reads - local_bindings(fn)


def closure_reads(fn: cst.FunctionDef) -> Set[str]:
    """free_reads less the names `fn` declares `global`: those reach the module, not
    the function around `fn`."""
    declared = {n.name.value for node in _own_nodes(fn) if isinstance(node, cst.Global) for n in node.names}
    return free_reads(fn) - declared


def nested_functions(resolver) -> List[Tuple[cst.FunctionDef, cst.FunctionDef]]:
    """(inner, outer) for each def written directly in another function's code (not
    a method of a class defined there), outer functions first."""
    out = []
    for fn in resolver.nodes(cst.FunctionDef):
        outer = resolver.enclosing_function(fn)
        if outer is not None and resolver.enclosing_class(fn) in (None, resolver.enclosing_class(outer)):
            out.append((fn, outer))
    return out


def closure_propagate(resolver, names: Dict) -> bool:
    """Adds to `names` (function -> set of names, or function -> dict name -> value)
    what each nested function reads from its enclosing function's entries without
    rebinding them; True when something was added."""
    changed = False
    for inner, outer in nested_functions(resolver):
        known = names.get(outer)
        if not known:
            continue
        free = closure_reads(inner)
        here = names.get(inner)
        for name in list(known):
            if name.split(".", 1)[0] not in free or (here is not None and name in here):
                continue
            if isinstance(known, dict):
                names.setdefault(inner, {})[name] = known[name]
            else:
                names.setdefault(inner, set()).add(name)
            here = names[inner]
            changed = True
    return changed


def functions_reading(resolver, scope: Optional[cst.FunctionDef], name: str) -> List[cst.FunctionDef]:
    """The functions that read `name` of `scope` (None: the module) without binding it
    themselves: top-level functions reading a global, defs nested in function `scope`
    reading it through their closure."""
    if scope is None:
        candidates = [fn for fn in resolver.nodes(cst.FunctionDef) if resolver.enclosing_function(fn) is None
                      and resolver.enclosing_class(fn) is None]
    else:
        return [inner for inner, outer in nested_functions(resolver) if outer is scope and name in closure_reads(inner)]
    return [fn for fn in candidates if name in free_reads(fn)]


_KEEPS_MODULE = {"train", "eval", "requires_grad_"}  # return the module itself, nothing moved


def nonlocal_rebinds(resolver, names: Dict) -> List[Tuple[cst.CSTNode, str]]:
    """(assignment, name) where a nested function declares `nonlocal name` for a name
    that holds a model in the function around it and binds it to something else than
    that module (`model = model.train()` aside): the enclosing function's model changes
    under the rewrite's feet, after it is sharded."""
    out = []
    for inner, outer in nested_functions(resolver):
        held = names.get(outer)
        if not held:
            continue
        declared = {n.name.value for node in _own_nodes(inner) if isinstance(node, cst.Nonlocal) for n in node.names}
        watched = declared & set(held)
        if not watched:
            continue
        for node in _own_nodes(inner):
            if isinstance(node, cst.Assign):
                targets = [t.target for t in node.targets]
            elif isinstance(node, (cst.AnnAssign, cst.AugAssign)):
                targets = [node.target]
            else:
                continue
            for name in sorted({n for t in targets for n in _target_names(t)} & watched):
                if not (isinstance(node, cst.Assign) and _same_module(node.value, name)):
                    out.append((node, name))
    return out


def _same_module(expr, name: str) -> bool:
    """`name`, `name.train()`, `name.eval().requires_grad_(False)`."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _KEEPS_MODULE:
        expr = expr.func.value
    return isinstance(expr, cst.Name) and expr.value == name
