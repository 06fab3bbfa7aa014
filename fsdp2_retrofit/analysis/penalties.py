"""Gradient penalties: `torch.autograd.grad(..., create_graph=True)` through a trained model,
whose graph a later backward() differentiates again (WGAN-GP, R1, DRAGAN).

FSDP2 frees each unit's gathered parameters after its backward; the penalty's second backward
still reads them. The recipe that trains at parity (measured on 2 CPU ranks against one process:
float32 within 3e-8, float64 within 6e-17, torch 2.13): every unit of the model keeps its
parameters gathered from forward (`reshard_after_forward=False`) through backward
(`set_reshard_after_backward(False)`), and the units are resharded by hand before the model's
optimizer steps, so the next forward gathers the stepped shards (without it the forward reuses
the gathered copy of the previous step's weights).

One order it cannot train: a forward of the model that feeds the same backward() but is made
after the penalty's graph. backward() then runs that forward's part first (autograd runs the
newest nodes first), FSDP2 reduce-scatters each unit's gradient when that part reaches it, and
the penalty's share of the gradient arrives after the reduction: it stays on the gathered copy
and never reaches the shards (measured: the last layer's gradient lost).

`penalties(facts)` finds each such call, the models its graph runs through (by value: the
forwards between `inputs=` and `outputs=`), and, where the recipe cannot apply, the node and the
reason to refuse at.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.syntax.torch_api import AUTOGRAD_GRAD

from .checkpoints import call_arg

_DEPTH = 8


@dataclass
class Penalty:
    call: cst.Call  # the autograd.grad(..., create_graph=...) call
    models: list = field(default_factory=list)  # the ModelSites its graph runs through
    # where the recipe cannot apply: (node, what, why, fix) of the refusal
    blocked: Optional[Tuple[cst.CSTNode, str, str, str]] = None


def penalties(facts) -> List[Penalty]:
    """Every `autograd.grad(..., create_graph=<not False>)` of the script, with its models (made once per facts)."""
    if facts.penalty_cache is None:
        facts.penalty_cache = _penalties(facts)
    return facts.penalty_cache


def _penalties(facts) -> List[Penalty]:
    r = facts.resolver
    out = []
    for call in r.nodes(cst.Call):
        if not r.is_call_to(call, AUTOGRAD_GRAD):
            continue
        graph = call_arg(call, 99, "create_graph")
        if graph is None or (isinstance(graph, cst.Name) and graph.value == "False"):
            continue
        fn = r.enclosing_function(call)
        if fn is not None and r.enclosing_class(fn) is None and not _callers(facts, fn) and not _backward_in(r, fn):
            continue  # a helper of the script nothing calls: no training step takes it
        out.append(_penalty(facts, call))
    return out


def penalty_models(facts) -> List:
    """The models a penalty the recipe covers runs through (each once)."""
    seen: Dict[int, object] = {}
    for p in penalties(facts):
        if p.blocked is None:
            for m in p.models:
                seen.setdefault(id(m), m)
    return list(seen.values())


def holds_recipe(facts, model) -> bool:
    """`<model>.set_reshard_after_backward(False)` is in the script (an output of this rewrite, or a
    hand conversion that keeps the units gathered)."""
    for call in facts.resolver.nodes(cst.Call):
        func = call.func
        if (isinstance(func, cst.Attribute) and func.attr.value == "set_reshard_after_backward" and call.args
                and code(call.args[0].value) == "False" and facts.model_held(func.value) is model):
            return True
    return False


def _penalty(facts, call: cst.Call) -> Penalty:
    penalty = Penalty(call)
    outputs, inputs = call_arg(call, 0, "outputs"), call_arg(call, 1, "inputs")
    graph = code(call_arg(call, 99, "create_graph"))
    if outputs is None or inputs is None:
        penalty.blocked = (call, f"`{code(call.func)}(..., create_graph={graph})` without readable outputs and inputs",
                           "the rewrite cannot tell which model the second backward runs through",
                           "pass `outputs=` and `inputs=` (or the first two arguments) as names or calls")
        return penalty
    flow = facts.analysis.flow
    stop = set(map(id, flow.values(inputs))) | {id(inputs)}
    models: Dict[int, object] = {}
    _follow(facts, outputs, stop, models, 0)
    penalty.models = list(models.values())
    if not penalty.models:
        penalty.blocked = (
            call, f"`{code(call.func)}(..., create_graph={graph})` takes a second backward through a module",
            f"its outputs (`{code(outputs)}`) do not come from the forward of a model the rewrite shards here, so it "
            "cannot keep that module's units gathered for the second backward (FSDP2 frees them after the first)",
            "call the model on the penalty's inputs where the script calls autograd.grad, or keep that module "
            "unsharded (DDP)")
        return penalty
    for model in penalty.models:
        if model.sharded and not holds_recipe(facts, model):
            penalty.blocked = (
                call, f"`{model.name}` is sharded already and takes a second backward here",
                "FSDP2 frees each unit's gathered parameters after its backward; the graph kept for the second "
                "backward still reads them",
                f"shard `{model.name}` with reshard_after_forward=False, call "
                f"`{model.name}.set_reshard_after_backward(False)`, and reshard its units before its optimizer step")
            return penalty
    for model in penalty.models:
        if not penalty_steps(facts, model):
            penalty.blocked = (
                call, f"`{code(call.func)}(..., create_graph={graph})` takes a second backward through `{model.name}`, "
                "whose optimizer step the rewrite does not find where a name holds the model",
                f"`{model.name}` keeps its units gathered through backward for the penalty and they must be resharded "
                "before each step of its optimizer (else the next forward computes with the old weights): there is "
                "no step to put that before",
                f"step the optimizer of `{model.name}` where the model is in reach (a name or `self.` attribute)")
            return penalty
    late = _forward_after(facts, call, penalty.models)
    if late is not None:
        forward, model, backward = late
        penalty.blocked = (
            forward,
            f"`{code(forward)}` runs `{model.name}` after the gradient penalty (line {facts.resolver.line(call)}), "
            + (f"before the next backward() (line {facts.resolver.line(backward)})" if backward is not None
               else "before any backward() takes the penalty"),
            "where one backward() takes both, it runs the newest forward first: FSDP2 reduce-scatters each unit's "
            "gradient when that forward's part reaches it, and the penalty's share of the gradient arrives after "
            "the reduction (it never reaches the shards)",
            f"call `{model.name}` on its other inputs before computing the penalty (or take the penalty's "
            "backward() first)")
    return penalty


def penalty_steps(facts: ScriptFacts, model) -> list:
    """(the `opt.step()` / `scaler.step(opt)` call, the expression holding `model` there) for every
    optimizer that trains `model`, in whatever function of the script it steps."""
    r = facts.resolver
    out = []
    for call in r.nodes(cst.Call):
        func = call.func
        if not isinstance(func, cst.Attribute) or func.attr.value != "step":
            continue
        fn = r.enclosing_function(call)
        known = facts.optimizer_names.get(fn, {})
        held = model.names.get(fn, set())
        for candidate in (func.value, call.args[0].value if call.args else None):
            name = code(candidate) if candidate is not None else None
            if name not in known:
                continue
            trained = known[name]
            if trained in held:
                out.append((call, trained))
            elif trained is None and len(held) == 1 and any(
                    o.name == name and model.name in o.models for o in facts.optimizers):
                out.append((call, next(iter(held))))
            break
    return out


def _collect(facts, expr, stop: Set[int], models: Dict[int, object], depth: int) -> None:
    """The models whose forwards `expr`'s value comes from, back to the penalty's inputs."""
    if depth > _DEPTH or id(expr) in stop:
        return
    if isinstance(expr, cst.Call):
        model = facts.model_held(expr.func)
        if model is not None:
            models.setdefault(id(model), model)
            for a in expr.args:
                if a.keyword is None and not a.star:
                    _follow(facts, a.value, stop, models, depth + 1)
            return
        if isinstance(expr.func, cst.Attribute):  # `scores.sum()`, `out.view(-1)`
            _follow(facts, expr.func.value, stop, models, depth + 1)
        return
    if isinstance(expr, cst.BinaryOperation):
        _follow(facts, expr.left, stop, models, depth + 1)
        _follow(facts, expr.right, stop, models, depth + 1)
    elif isinstance(expr, cst.UnaryOperation):
        _follow(facts, expr.expression, stop, models, depth + 1)
    elif isinstance(expr, cst.Subscript):
        _follow(facts, expr.value, stop, models, depth + 1)


def _follow(facts, expr, stop: Set[int], models: Dict[int, object], depth: int) -> None:
    if id(expr) in stop:
        return
    if isinstance(expr, (cst.Call, cst.BinaryOperation, cst.UnaryOperation, cst.Subscript)):
        _collect(facts, expr, stop, models, depth)
        return
    for origin in facts.analysis.flow.values(expr):
        if isinstance(origin, tuple):  # an element of a value not seen into: `out, aux = D(x)`
            origin = origin[0]
        if isinstance(origin, cst.BaseExpression) and origin is not expr:
            _collect(facts, origin, stop, models, depth)


def _forward_after(facts, call: cst.Call, models) -> Optional[tuple]:
    """(forward call, its model, the backward() after it or None): a forward of one of `models` that
    the step makes after the penalty and before the next backward() or optimizer step."""
    r = facts.resolver
    site = _step_site(facts, call)
    stmt = r.statement_of(site)
    block = r.block_of(stmt) if stmt is not None else None
    if block is None:
        return None
    body = list(block.body)
    found = None
    for later in body[body.index(stmt) + 1:]:
        for node in r.descendants(later, cst.Call):
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value in ("backward", "step"):
                return (found[0], found[1], node if func.attr.value == "backward" else None) if found else None
            if found is None:
                model = facts.model_held(func)
                if model is not None and any(model is m for m in models):
                    found = (node, model)
    return (found[0], found[1], None) if found else None


def _step_site(facts, call: cst.Call) -> cst.CSTNode:
    """The call in the training step that computes the penalty: `call` itself, or the call of the helper
    or method holding it (followed outward while the function holding it is called from one place and
    calls no backward())."""
    r = facts.resolver
    site = call
    for _ in range(_DEPTH):
        fn = r.enclosing_function(site)
        if fn is None or _backward_in(r, fn):
            return site
        callers = _callers(facts, fn)
        if len(callers) != 1:
            return site
        site = callers[0]
    return site


def _backward_in(r, fn: cst.FunctionDef) -> bool:
    return any(isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward" for c in r.descendants(fn, cst.Call))


def _callers(facts, fn: cst.FunctionDef) -> List[cst.Call]:
    """The calls of the script that run `fn`: by its name, or as a method (`self.penalty(...)`)."""
    analysis = facts.analysis
    found = list(analysis.calls_of(fn))
    for c in facts.resolver.nodes(cst.Call):
        if (isinstance(c.func, cst.Attribute) and c.func.attr.value == fn.name.value
                and any(m is fn for m in analysis.flow.methods_called(c)) and c not in found):
            found.append(c)
    return found
