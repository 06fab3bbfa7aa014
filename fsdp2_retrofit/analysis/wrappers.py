"""DDP and DataParallel wrappers in a script: where the model is wrapped, with which
arguments, and what the script does through the wrapper (`.module`, `no_sync()`,
`require_backward_grad_sync`).

The migrate_ddp stage asks these questions; it never re-derives them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import code, instance_attribute
from fsdp2_retrofit.syntax.rank import mentions_rank
from fsdp2_retrofit.syntax.torch_api import DATA_PARALLEL, DDP, MANUAL_SEED
NULL_CONTEXTS = {"contextlib.nullcontext"}


@dataclass
class WrapSite:
    """`name = DDP(<inner>, ...)`: the statement, the call, which wrapper."""

    name: str  # the name, or `self.model` for an instance attribute
    stmt: cst.SimpleStatementLine
    call: cst.Call
    kind: str  # "DistributedDataParallel" | "DataParallel"
    inner: cst.BaseExpression  # the wrapped module expression
    kwargs: Dict[str, cst.BaseExpression] = field(default_factory=dict)


@dataclass
class WrapperFacts:
    sites: List[WrapSite]
    # wrapper calls that are not `name = Wrapper(module, ...)` statements
    other_calls: List[cst.Call]
    # other uses of the wrapper classes (isinstance(model, DDP), subclassing)
    other_uses: List[cst.CSTNode]
    # `model.module` attribute nodes (model: a name that holds a wrapped model there)
    module_accesses: List[cst.Attribute]
    # `getattr(model, "module", model)` calls
    module_getattrs: List[cst.Call]
    # `with model.no_sync():` statements, and calls of no_sync outside a with item
    no_sync_withs: List[cst.With]
    no_sync_calls: List[cst.Call]
    # `ctx = model.no_sync() if cond else nullcontext()`: (statement, condition, sync when cond)
    no_sync_choices: List[tuple]
    # `model.require_backward_grad_sync = flag`
    grad_sync_flags: List[cst.SimpleStatementLine]
    # `torch.manual_seed(... rank ...)`: models built differently on each rank
    rank_seeds: List[cst.Call]
    wrapped_names: Set[str]


def wrappers(facts) -> WrapperFacts:
    r = facts.resolver
    sites, other_calls = [], []
    wrapper_calls = set()
    for call in r.nodes(cst.Call):
        kind = _kind(call, r)
        if kind is None:
            continue
        wrapper_calls.add(call.func)
        stmt = r.statement_of(call)
        site = _site(stmt, call, kind, r)
        (sites if site is not None else other_calls).append(site or call)
    wrapped = {s.name for s in sites}
    wrapper_names = DDP | DATA_PARALLEL
    other_uses = [
        n for kind in (cst.Name, cst.Attribute)
        for n in r.nodes(kind)
        if r.qnames(n) & wrapper_names and n not in wrapper_calls and not _in_import(n, r)
        and not (isinstance(r.parent(n), cst.Attribute) and r.parent(n).attr is n)
    ]
    other_uses = [n for n in other_uses if not any(a in other_uses for a in r.ancestors(n))]

    def holds_wrapper(expr, node) -> bool:
        """`model`, or `self.model` in a trainer's method, holding the wrapped model."""
        held = facts.model_names.get(r.enclosing_function(node), set())
        if isinstance(expr, cst.Name):
            return expr.value in wrapped | held
        return instance_attribute(expr) in held | wrapped

    module_accesses = [
        a for a in r.nodes(cst.Attribute)
        if a.attr.value == "module" and holds_wrapper(a.value, a)
    ] if sites else []
    module_getattrs = [
        c for c in r.nodes(cst.Call)
        if isinstance(c.func, cst.Name) and c.func.value == "getattr" and len(c.args) == 3
        and holds_wrapper(c.args[0].value, c) and isinstance(c.args[1].value, cst.SimpleString)
        and c.args[1].value.evaluated_value == "module" and code(c.args[2].value) == code(c.args[0].value)
    ] if sites else []
    no_sync_calls = [
        c for c in r.nodes(cst.Call)
        if isinstance(c.func, cst.Attribute) and c.func.attr.value == "no_sync" and holds_wrapper(c.func.value, c)
    ]
    withs = []
    for w in r.nodes(cst.With):
        if any(item.item in no_sync_calls for item in w.items):
            withs.append(w)
    in_withs = {item.item for w in withs for item in w.items}
    choices = []
    for stmt in r.nodes(cst.SimpleStatementLine):
        choice = _choice(stmt, no_sync_calls, r)
        if choice is not None:
            choices.append(choice)
    chosen = {c[3] for c in choices}
    flags = [
        s for s in r.nodes(cst.SimpleStatementLine)
        if len(s.body) == 1 and isinstance(s.body[0], cst.Assign) and len(s.body[0].targets) == 1
        and isinstance(s.body[0].targets[0].target, cst.Attribute)
        and s.body[0].targets[0].target.attr.value == "require_backward_grad_sync"
        and holds_wrapper(s.body[0].targets[0].target.value, s)
    ]
    seeds = [
        c for c in r.nodes(cst.Call)
        if r.qnames(c) & MANUAL_SEED
        and any(mentions_rank(a.value) for a in c.args)
    ]
    return WrapperFacts(
        sites=sites,
        other_calls=other_calls,
        other_uses=other_uses,
        module_accesses=module_accesses,
        module_getattrs=module_getattrs,
        no_sync_withs=withs,
        no_sync_calls=[c for c in no_sync_calls if c not in in_withs and c not in chosen],
        no_sync_choices=choices,
        grad_sync_flags=flags,
        rank_seeds=seeds,
        wrapped_names=wrapped,
    )


def _kind(call: cst.Call, r) -> Optional[str]:
    names = r.qnames(call)
    if names & DDP:
        return "DistributedDataParallel"
    if names & DATA_PARALLEL:
        return "DataParallel"
    return None


def _site(stmt, call: cst.Call, kind: str, r) -> Optional[WrapSite]:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    assign = stmt.body[0]
    if not isinstance(assign, cst.Assign) or assign.value is not call or len(assign.targets) != 1:
        return None
    target = assign.targets[0].target
    positional = [a for a in call.args if a.keyword is None and not a.star]
    module_kw = [a for a in call.args if a.keyword is not None and a.keyword.value == "module"]
    inner = positional[0].value if positional else module_kw[0].value if module_kw else None
    if inner is None or any(a.star for a in call.args):
        return None
    if isinstance(target, cst.Name):
        name = target.value
    elif _own_attribute(target, stmt, r):  # `self.model = DDP(self.model, ...)` in a trainer's method
        name = instance_attribute(target)
    else:
        return None
    kwargs = {a.keyword.value: a.value for a in call.args if a.keyword is not None and a.keyword.value != "module"}
    for i, a in enumerate(positional[1:], start=1):
        kwargs[("device_ids", "output_device", "dim")[i - 1] if i <= 3 else f"arg{i}"] = a.value
    return WrapSite(name, stmt, call, kind, inner, kwargs)


def _own_attribute(target, stmt, r) -> bool:
    """`self.<attr>` set in a method of a class, `self` its first parameter: the attribute its
    other methods read (holders follow it); another object's attribute is not followed."""
    fn = r.enclosing_function(stmt)
    owner = r.enclosing_class(stmt)
    return (
        instance_attribute(target) is not None and fn is not None and owner is not None
        and r.parent(r.parent(fn)) is owner and bool(fn.params.params)
        and fn.params.params[0].name.value == target.value.value
    )


def _in_import(node, r) -> bool:
    return any(isinstance(a, (cst.Import, cst.ImportFrom)) for a in r.ancestors(node))


def _choice(stmt, no_sync_calls, r):
    """`ctx = model.no_sync() if cond else nullcontext()` (either way round):
    (stmt, context name, the condition under which gradients sync, the no_sync call)."""
    if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign) or len(stmt.body[0].targets) != 1:
        return None
    target, value = stmt.body[0].targets[0].target, stmt.body[0].value
    if not isinstance(target, cst.Name) or not isinstance(value, cst.IfExp):
        return None
    if value.body in no_sync_calls and r.is_call_to(value.orelse, NULL_CONTEXTS):
        return stmt, target.value, ("not", value.test), value.body
    if value.orelse in no_sync_calls and r.is_call_to(value.body, NULL_CONTEXTS):
        return stmt, target.value, ("", value.test), value.orelse
    return None


def context_withs(facts, name: str, after) -> List[cst.With]:
    """`with <name>:` statements of the function that binds `name`."""
    r = facts.resolver
    fn = r.enclosing_function(after)
    return [
        w for w in r.nodes(cst.With)
        if r.enclosing_function(w) is fn and any(
            isinstance(i.item, cst.Name) and i.item.value == name for i in w.items
        )
    ]


def reads_of(facts, name: str, fn) -> List[cst.Name]:
    r = facts.resolver
    return [n for n in r.nodes(cst.Name) if n.value == name and r.enclosing_function(n) is fn]


__all__ = ["WrapSite", "WrapperFacts", "wrappers", "context_withs", "reads_of"]
