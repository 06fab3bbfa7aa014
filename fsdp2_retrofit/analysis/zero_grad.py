"""`<model>.zero_grad()` between the model's forward and backward().

After a forward, FSDP2 keeps the root's parameters (and those of the last block, whose
reshard_after_forward is off) gathered until backward: the module's registered
parameters are then the unsharded tensors, so `model.zero_grad()` clears those, not
the sharded parameters that hold the gradients of the step before. Those pile up.
The optimizer holds the sharded parameters: its zero_grad() clears the right ones.

Shared by the rewrite (codemods/zero_grad.py, which asks with the model names of
ScriptFacts) and `check` (rule FSD113, which asks with ShardFacts): the caller says
which expressions are a whole model at a place.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import Resolver
from dataclasses import dataclass

# (expression, the node where it is read) -> the model's name when it is a whole model there
ModelOf = Callable[[cst.BaseExpression, cst.CSTNode], Optional[str]]


@dataclass
class ZeroGradBetween:
    call: cst.Call  # `<model>.zero_grad(...)`
    model: str  # the model's name at the call
    forward: cst.Call  # a forward of that model before it (directly, through a helper given the model, or
    # through a method of the class that runs it: `loss = self._loss_step(batch)`)
    backward: cst.Call  # a `.backward()` after it


def zero_grads_between(resolver: Resolver, model_of: ModelOf, helpers: Iterable[str] = ()) -> List[ZeroGradBetween]:
    """Every `<model>.zero_grad()` with a forward of that model before it and a
    `.backward()` after it, in the same loop body (or, outside loops, the same
    function body): nested functions are looked at on their own."""
    helpers = set(helpers)
    out = []
    for call in resolver.nodes(cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "zero_grad"):
            continue
        model = model_of(func.value, call)
        if model is None:
            continue
        fn = resolver.enclosing_function(call)
        region = _region(resolver, call, fn)
        here = resolver.order(call)
        calls = [c for c in resolver.descendants(region, cst.Call) if resolver.enclosing_function(c) is fn]
        forward = next(
            (c for c in calls if resolver.order(c) < here and _forwards(c, model, model_of, helpers, resolver)), None
        )
        backward = next(
            (c for c in calls if resolver.order(c) > here and isinstance(c.func, cst.Attribute)
             and c.func.attr.value == "backward"), None,
        )
        if forward is not None and backward is not None:
            out.append(ZeroGradBetween(call, model, forward, backward))
    return out


def _region(resolver: Resolver, call: cst.CSTNode, fn: Optional[cst.FunctionDef]) -> cst.CSTNode:
    """The body of the innermost loop holding `call` inside `fn`; else fn's body (the module's)."""
    child = call
    for anc in resolver.ancestors(call):
        if anc is fn:
            return anc.body
        if isinstance(anc, (cst.For, cst.While)) and child is anc.body:
            return anc.body
        child = anc
    return resolver.module


_METHOD_DEPTH = 3  # methods calling methods, followed at most


def _forwards(call: cst.Call, model: str, model_of: ModelOf, helpers: set, resolver: Optional[Resolver] = None,
              depth: int = _METHOD_DEPTH) -> bool:
    func = call.func
    if model_of(func, call) == model:
        return True  # model(x)
    if isinstance(func, cst.Attribute) and func.attr.value == "forward" and model_of(func.value, call) == model:
        return True  # model.forward(x)
    if isinstance(func, cst.Name) and func.value in helpers:  # loss = compute_loss(model, batch)
        return any(model_of(arg.value, call) == model for arg in call.args)
    # loss = self._loss_step(batch), whose body runs `self._model(...)` (only a model held on
    # `self`: a local name of another method is another variable)
    method = _own_method(resolver, call) if resolver is not None and depth > 0 and model.startswith("self.") else None
    if method is not None:
        return any(_forwards(c, model, model_of, helpers, resolver, depth - 1)
                   for c in resolver.descendants(method.body, cst.Call) if resolver.enclosing_function(c) is method)
    return False


def _own_method(resolver: Resolver, call: cst.Call) -> Optional[cst.FunctionDef]:
    """The method `self.<name>(...)` runs: one the class around the call defines (a model held
    on `self` is the same attribute there)."""
    func = call.func
    if not (type(func) is cst.Attribute and type(func.value) is cst.Name and func.value.value == "self"):
        return None
    cls = resolver.enclosing_class(call)
    if cls is None:
        return None
    return next((m for m in cls.body.body if type(m) is cst.FunctionDef and m.name.value == func.attr.value), None)
