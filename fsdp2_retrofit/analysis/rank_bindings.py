"""Names a function binds only inside rank-0 branches, and the values computed from them.

`if rank == 0: cfg = load()` binds `cfg` on rank 0 alone: on every other rank the
name does not exist, and code after the branch that every rank runs (a collective,
a save) fails there with NameError (or UnboundLocalError) while rank 0 waits in the
collective. `rank_zero_only_bindings` lists, per scope (a function, or None for the
module), the names whose every binding is inside a rank-0 branch, with the first
such binding. `rank_zero_reads` follows the values a statement reads back to such
names, through the assignments and arguments every rank runs (`path =
f"{out_dir}/m.pt"` read by a save): the rewrite (analysis.checkpoints.rank_zero_names)
and the check (FSD116) ask it with their own notion of a rank-0 branch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import assigned_names, bind_args, names_read, parameter_names

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


# -- values that come from a rank-0-only name ------------------------------------------

@dataclass(frozen=True)
class RankZeroRead:
    """A statement every rank runs reads `name`, bound only on rank 0 (at `binding`,
    under `gate`), directly or through `chain`: (name, the statement that hands it on)
    pairs from the name read first down to the one that reads `name` (`path = f"{out_dir}/m.pt"`,
    an assignment; `save(model, out_dir)`, the call that binds a parameter). `reader`
    is the statement of `name`'s own function that reads it on every rank."""

    name: str
    binding: cst.CSTNode = field(repr=False)
    gate: cst.If = field(repr=False)
    reader: cst.CSTNode = field(repr=False)
    chain: Tuple[Tuple[str, cst.CSTNode], ...] = field(default=(), repr=False)
    # the other ranks bind the name too, to a value of their own (`run_dir = None` before the gate,
    # or in its `else`): the first such binding; None where rank 0 alone binds it
    otherwise: Optional[cst.CSTNode] = field(default=None, repr=False)

    def describe(self, line) -> str:
        """"`path` (line 30), which reads `out_dir`, bound only on rank 0 at line 22";
        `line` gives a node's line."""
        links = [f"`{name}` ({'line' if name in assigned_names(stmt) else 'the argument on line'} {line(stmt)})"
                 for name, stmt in self.chain]
        bound = (f", bound only on rank 0 at line {line(self.binding)}" if self.otherwise is None else
                 f", bound on rank 0 at line {line(self.binding)} and to another value on the other ranks at line "
                 f"{line(self.otherwise)}")
        return ", which reads ".join(links + [f"`{self.name}`"]) + bound


def rank_zero_reads(
    resolver,
    stmt: cst.CSTNode,
    names: Iterable[str],
    rank_zero_only: Callable[[Scope, str, cst.CSTNode], Optional[Tuple[cst.CSTNode, cst.If]]],
    runs_everywhere: Callable[[cst.CSTNode], bool],
) -> List[RankZeroRead]:
    """The rank-0-only names the values of `names`, read by `stmt`, come from: each
    name is followed back through the assignments that bind it on every rank before
    `stmt` (`path = os.path.join(out_dir, "m.pt")`, `p2 = path`, `a, b = out_dir, 1`,
    `f(out_dir)`) and, for a parameter of a function of the script, through the
    arguments of its calls that every rank makes. `rank_zero_only(scope, name, at)` gives
    the rank-0 binding and its `if` of a name the scope binds on rank 0 alone, read at `at`
    (and, as a third element, the binding of the other ranks' own value where they bind it too);
    `runs_everywhere(statement)` says whether every rank runs a statement (the caller's
    gates: the rewrite's split ones run everywhere)."""
    out: List[RankZeroRead] = []
    seen: Set[Tuple[int, str]] = set()
    functions = {f.name.value: f for f in resolver.nodes(cst.FunctionDef)
                 if resolver.enclosing_function(f) is None and resolver.enclosing_class(f) is None}

    def follow(at: cst.CSTNode, name: str, chain: Tuple[Tuple[str, cst.CSTNode], ...]) -> None:
        scope = _scope_binding(resolver, at, name)
        if (id(scope), name) in seen:
            return
        seen.add((id(scope), name))
        if scope is not None and name in parameter_names(scope):
            if functions.get(scope.name.value) is not scope:
                return
            for call in resolver.nodes(cst.Call):
                if not (isinstance(call.func, cst.Name) and call.func.value == scope.name.value):
                    continue
                caller = resolver.statement_of(call)
                if caller is None or not runs_everywhere(caller):
                    continue
                for param, arg in bind_args(scope, call):
                    if param == name:
                        for read in sorted(names_read(arg)):
                            follow(caller, read, chain + ((name, caller),))
            return
        found = rank_zero_only(scope, name, at)
        if found is not None:
            out.append(RankZeroRead(name, found[0], found[1], at, chain, *found[2:]))
            return
        same_scope = resolver.enclosing_function(at) is scope
        for binding in resolver.descendants(scope if scope is not None else resolver.module, cst.SimpleStatementLine):
            if (resolver.enclosing_function(binding) is not scope or name not in assigned_names(binding)
                    or (same_scope and resolver.order(binding) >= resolver.order(at))
                    or not runs_everywhere(binding)):
                continue
            for read in sorted(_value_reads(binding)):
                follow(binding, read, chain + ((name, binding),))

    for name in sorted(set(names)):
        follow(stmt, name, ())
    return out


def _scope_binding(resolver, at: cst.CSTNode, name: str) -> Scope:
    """The function (None: the module) whose `name` `at` reads: its own, or the nearest
    function around it that binds the name (a closure)."""
    scope = resolver.enclosing_function(at)
    while scope is not None and name not in parameter_names(scope) and name not in _bound_in(resolver, scope):
        scope = resolver.enclosing_function(scope)
    return scope


def _bound_in(resolver, scope: cst.FunctionDef) -> Set[str]:
    """Names `scope` binds itself (anywhere in its body, nested functions' bodies apart)."""
    cache = resolver.__dict__.setdefault("_rank_bound_in", {})
    if not cache:
        for node, bound in binding_targets(resolver):
            cache.setdefault(id(resolver.enclosing_function(node)), set()).add(bound)
    return cache.get(id(scope), set())


def _value_reads(stmt: cst.SimpleStatementLine) -> Set[str]:
    """Names the values an assignment statement binds are computed from."""
    found: Set[str] = set()
    for small in stmt.body:
        if isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None:
            found |= names_read(small.value)
        elif isinstance(small, cst.AugAssign):
            found |= names_read(small.value) | names_read(small.target)
    return found
