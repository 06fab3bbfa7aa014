"""Names and instance attributes that hold the process's rank, read by value.

`self.gpu_id = int(os.environ["LOCAL_RANK"])` makes `if self.gpu_id == 0:` a rank-0 branch
although no word of `gpu_id` says so: the rank classifier (syntax/rank.py) recognises rank
names by their last word, and these are the names it is told besides, found by the value
every binding gives them (`dist.get_rank()`, `int(os.environ["RANK"])`, `int(os.environ["LOCAL_RANK"])`,
another such name). Scoped: a plain name to the function that binds it, `self.x` to the class
whose methods bind it.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import bind_args, instance_attribute, parameter_names
from fsdp2_retrofit.syntax.rank import is_local_rank_value, is_rank_value


class RankAliases:
    """The rank names of one resolver's tree, found on the first question."""

    def __init__(self, resolver) -> None:
        self.r = resolver
        self._by_scope: Optional[Dict[int, set]] = None

    def at(self, node: cst.CSTNode) -> FrozenSet[str]:
        """The names (`gpu_id`) and attributes (`self.gpu_id`) that hold a rank where `node` is."""
        if self._by_scope is None:
            self._by_scope = _aliases(self.r)
        found = set(self._by_scope.get(id(self.r.enclosing_function(node)), ()))
        owner = self.r.enclosing_class(node)
        if owner is not None:
            found |= self._by_scope.get(id(owner), set())
        return frozenset(found)


def aliases_of(resolver) -> RankAliases:
    """The RankAliases of a resolver's tree, made once for every analysis that asks (the
    stages' facts, sharding's rank-0 branches, logs' gates)."""
    found = resolver.derived.get("rank_aliases")
    if found is None:
        found = resolver.derived["rank_aliases"] = RankAliases(resolver)
    return found


def rank_aliases(node: cst.CSTNode, facts) -> FrozenSet[str]:
    """RankAliases.at for a script's facts."""
    return aliases_of(facts.resolver).at(node)


def _aliases(r) -> Dict[int, set]:
    bound: Dict[tuple, List[Optional[tuple]]] = {}  # (scope id, text) -> (value, the scope it is read in)
    for assign in r.nodes(cst.Assign):
        for t in assign.targets:
            key = scope_key(r, t.target, assign)
            if key is not None:
                bound.setdefault(key, []).append((assign.value, assign))
    for fn, calls, skip in called_functions(r):  # a parameter is what every call hands it
        passed: Dict[str, list] = {}
        for call in calls:
            for param, arg in bind_args(fn, call, skip):
                passed.setdefault(param, []).append((arg, call))
        for param in parameter_names(fn):
            values = passed.get(param, [])
            if len(values) < len(calls) or any(a.star for c in calls for a in c.args):
                values = values + [None]  # a call that does not hand it (a default, *args)
            bound.setdefault((id(fn), param), []).extend(values)
    for kind in (cst.AugAssign, cst.AnnAssign, cst.For):
        for node in r.nodes(kind):  # bound otherwise as well: not a rank for sure
            key = scope_key(r, node.target, node)
            if key in bound:
                bound[key].append(None)
    out: Dict[int, set] = {}
    changed = True
    while changed:  # a name handed a name found a rank in the round before
        changed = False
        for (scope, text), values in bound.items():
            if text in out.get(scope, ()) or not values:
                continue
            if all(v is not None and _is_rank(v[0], r, out, v[1]) for v in values):
                out.setdefault(scope, set()).add(text)
                changed = True
    return out


def scope_key(r, target, node) -> Optional[tuple]:
    """(scope id, text) of a plain name or a `self.x` bound or read at `node`: the flow is
    flow-insensitive, so one key holds the same values throughout its scope."""
    if isinstance(target, cst.Name):
        return id(r.enclosing_function(node)), target.value
    if instance_attribute(target) is not None and target.value.value == "self":
        owner = r.enclosing_class(node)
        return (id(owner), instance_attribute(target)) if owner is not None else None
    return None


def called_functions(r):
    """(function, its calls, parameters the calls skip) for the top-level functions called by
    name and the __init__ of top-level classes constructed by name."""
    found = r.derived.get("called_functions")
    if found is None:
        found = r.derived["called_functions"] = list(_called_functions(r))
    return found


def _called_functions(r):
    module = r.module
    by_name: Dict[str, tuple] = {}
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef):
            by_name[stmt.name.value] = (stmt, 0)
        elif isinstance(stmt, cst.ClassDef):
            init = next((s for s in stmt.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None)
            if init is not None:
                by_name[stmt.name.value] = (init, 1)
    calls: Dict[str, list] = {}
    for call in r.nodes(cst.Call):
        if isinstance(call.func, cst.Name) and call.func.value in by_name:
            calls.setdefault(call.func.value, []).append(call)
    for name, found in calls.items():
        fn, skip = by_name[name]
        yield fn, found, skip


def _is_rank(value: cst.BaseExpression, r, found: Optional[Dict[int, set]] = None, where=None) -> bool:
    if is_rank_value(value, r) or is_local_rank_value(value):
        return True
    if found is None or where is None:
        return False
    if isinstance(value, cst.Name):
        return value.value in found.get(id(r.enclosing_function(where)), ())
    owner = r.enclosing_class(where) if instance_attribute(value) is not None else None
    return owner is not None and instance_attribute(value) in found.get(id(owner), ())


__all__ = ["RankAliases", "aliases_of", "called_functions", "rank_aliases", "scope_key"]
