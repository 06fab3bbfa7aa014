"""Functions of the script that build and return an optimizer.

`def make_optimizer(model, lr): return torch.optim.AdamW(model.parameters(), lr=lr)`,
called as `optimizer = make_optimizer(model, 3e-4)`: the optimizer is built where the
function is called. Shared by the rewrite (analysis/optimizers.py follows such a call
to the model it trains) and `check` (analysis/sharding.py counts it as an optimizer
built at the call, for FSD103). Light: libcst and the syntax layer only, since it is
on `check`'s start-up path.
"""
from __future__ import annotations

from typing import Callable, Optional, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import SELF_RETURNING_METHODS, assigned_names, calls_in, code, walk


def returned_optimizer(fn: cst.FunctionDef, is_optimizer: Callable[[cst.Call], bool]) -> Optional[cst.Call]:
    """The one optimizer call (`is_optimizer`) that `fn` builds, when every `return`
    gives it back (directly, or through the name it is bound to) and `fn` defines no
    function, lambda or class of its own; else None."""
    if any(type(n) in (cst.FunctionDef, cst.Lambda, cst.ClassDef) for n in walk(fn.body)):
        return None
    builds = [c for c in calls_in(fn) if is_optimizer(c)]
    if len(builds) != 1:
        return None
    built = builds[0]
    holders = {
        name for stmt in walk(fn.body)
        if type(stmt) is cst.SimpleStatementLine and any(getattr(s, "value", None) is built for s in stmt.body)
        for name in assigned_names(stmt)
    }
    returns = [n for n in walk(fn.body) if type(n) is cst.Return]
    if returns and all(r.value is built or (type(r.value) is cst.Name and r.value.value in holders) for r in returns):
        return built
    return None


def changes_tensors(fn: cst.FunctionDef) -> bool:
    """Whether `fn` may change a module or its parameters rather than only read them: an
    in-place method (`requires_grad_`, `zero_`), a placement or mode change (`.to()`,
    `.half()`, `.train()`), or an assignment to an attribute (`p.requires_grad = False`)."""
    for node in walk(fn.body):
        kind = type(node)
        if kind is cst.Call and isinstance(node.func, cst.Attribute):
            name = node.func.attr.value
            if name in SELF_RETURNING_METHODS or (name.endswith("_") and not name.startswith("_")):
                return True
        elif kind in (cst.Assign, cst.AugAssign, cst.AnnAssign):
            targets = [t.target for t in node.targets] if kind is cst.Assign else [node.target]
            if any(type(t) in (cst.Attribute, cst.Subscript) for t in targets):
                return True
    return False


def parameter_handing_calls(resolver) -> Set[int]:
    """The calls with `x.parameters()` / `x.named_parameters()` inside one of their arguments, by id: the
    candidates for an optimizer built by a factory the analysis does not see into (`config.instantiate(
    cfg.optimizer, model.parameters())`). Indexed once a module: walking every call's arguments for it cost
    check 60 % more CPU on torch/distributed."""
    out: Set[int] = set()
    for call in resolver.nodes(cst.Call):
        func = call.func
        if type(func) is cst.Attribute and func.attr.value in ("parameters", "named_parameters"):
            out.update(id(a) for a in resolver.ancestors(call) if type(a) is cst.Call)
    return out


def stepped(resolver, target: cst.BaseExpression, scope_of) -> bool:
    """`<target>.step()` is called: in the function that binds a name (`scope_of`: the function around a
    node), in a method of the class that stores `self.<attr>`."""
    spelled = code(target)
    owner = resolver.enclosing_class(target) if spelled.startswith("self.") else None
    scope = scope_of(target)
    for call in resolver.nodes(cst.Call):
        func = call.func
        if type(func) is not cst.Attribute or func.attr.value != "step" or code(func.value) != spelled:
            continue
        if owner is not None and resolver.enclosing_class(call) is owner or owner is None and scope_of(call) is scope:
            return True
    return False
