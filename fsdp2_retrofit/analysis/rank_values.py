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

from fsdp2_retrofit.syntax.names import instance_attribute
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


def rank_aliases(node: cst.CSTNode, facts) -> FrozenSet[str]:
    """RankAliases.at for a script's facts (made once per analysis)."""
    if facts.rank_alias_cache is None:
        facts.rank_alias_cache = RankAliases(facts.resolver)
    return facts.rank_alias_cache.at(node)


def _aliases(r) -> Dict[int, set]:
    bound: Dict[tuple, List[Optional[cst.BaseExpression]]] = {}  # (scope id, text) -> values
    for assign in r.nodes(cst.Assign):
        for t in assign.targets:
            target = t.target
            if isinstance(target, cst.Name):
                key = (id(r.enclosing_function(assign)), target.value)
            elif instance_attribute(target) is not None and target.value.value == "self":
                owner = r.enclosing_class(assign)
                if owner is None:
                    continue
                key = (id(owner), instance_attribute(target))
            else:
                continue
            bound.setdefault(key, []).append(assign.value)
    for kind in (cst.AugAssign, cst.AnnAssign, cst.For):
        for node in r.nodes(kind):  # bound otherwise as well: not a rank for sure
            target = node.target
            if isinstance(target, cst.Name):
                key = (id(r.enclosing_function(node)), target.value)
            elif instance_attribute(target) is not None and r.enclosing_class(node) is not None:
                key = (id(r.enclosing_class(node)), instance_attribute(target))
            else:
                continue
            if key in bound:
                bound[key].append(None)
    out: Dict[int, set] = {}
    for (scope, text), values in bound.items():
        if all(v is not None and _is_rank(v, r) for v in values):
            out.setdefault(scope, set()).add(text)
    return out


def _is_rank(value: cst.BaseExpression, r) -> bool:
    return is_rank_value(value, r) or is_local_rank_value(value)


__all__ = ["RankAliases", "rank_aliases"]
