"""Models and optimizers held where they were not built: a global a top-level function
reads, a parameter its calls bind, a `self.<attr>` a constructor sets.

The per-function model and optimizer names (models.py, optimizers.py) follow values
through these; the checkpoint stages refuse a state dict whose optimizer was lost on
the way (call sites that disagree), naming the line where it was lost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import libcst as cst

from .closures import free_reads, local_bindings
from .flow import keeps_attribute
from fsdp2_retrofit.syntax.names import bind_args, code, module_itself
from fsdp2_retrofit.syntax.torch_api import DATA_PARALLEL, DDP

# (function, name) -> (the node where the value was lost, why)
Lost = Dict[Tuple[Optional[cst.FunctionDef], str], Tuple[cst.CSTNode, str]]


def home_scope(resolver, name: str, fn: Optional[cst.FunctionDef]) -> Optional[cst.FunctionDef]:
    """The function whose binding of `name` a read of it in `fn` reaches (None: the module)."""
    root = name.split(".", 1)[0]
    while fn is not None:
        if root in local_bindings(fn):
            return fn
        fn = resolver.enclosing_function(fn)
    return None


def same_value(resolver, name: str, there: Optional[cst.FunctionDef], here: Optional[cst.FunctionDef]) -> bool:
    """`name` read in `here` is the variable it is in `there` (a global neither rebinds,
    a closure variable)."""
    return home_scope(resolver, name, there) is home_scope(resolver, name, here)


def model_in_callee(resolver, model: Optional[str], bound, caller, callee) -> Optional[str]:
    """The name in `callee` holding `model` (a name in `caller`): the parameter the call
    binds to it, or the same variable where `callee` sees it (a global, a closure)."""
    if not model:
        return None
    there = [p for p, a in bound if isinstance(a, cst.Name) and a.value == model]
    if there:
        return there[0]
    return model if same_value(resolver, model, caller, callee) else None


def top_level_functions(module: cst.Module) -> List[cst.FunctionDef]:
    return [s for s in module.body if isinstance(s, cst.FunctionDef)]


def global_optimizers(resolver, module: cst.Module, names) -> bool:
    """A top-level function reading a module-level optimizer as a global holds it, mapped
    to the model it trains where the function sees that model's global too."""
    top = names.get(None)
    if not top:
        return False
    changed = False
    for fn in top_level_functions(module):
        free = free_reads(fn)
        here = names.get(fn, {})
        for name, model in list(top.items()):
            if name in here or name.split(".", 1)[0] not in free:
                continue
            inside = model if model and same_value(resolver, model, None, fn) else None
            names.setdefault(fn, {})[name] = inside
            here = names[fn]
            changed = True
    return changed


@dataclass
class Holder:
    """`self.<attr> = <param>` in a class's __init__, the attribute's only assignment."""

    cls: cst.ClassDef
    attr: str
    param: str
    init: cst.FunctionDef
    reassigned: Optional[cst.CSTNode] = None  # another assignment of the attribute (or of the parameter)

    def methods(self):
        """(method, the name of its instance parameter) for each method of the class."""
        for stmt in self.cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.params.params and not stmt.decorators:
                yield stmt, stmt.params.params[0].name.value

    def constructions(self, resolver) -> List[cst.Call]:
        name = self.cls.name.value
        return [c for c in resolver.nodes(cst.Call) if isinstance(c.func, cst.Name) and c.func.value == name]

    def bound(self, call: cst.Call) -> Dict[str, cst.BaseExpression]:
        return dict(bind_args(self.init, call, skip=1))


def _attribute_assignments(resolver) -> Dict[tuple, List[cst.CSTNode]]:
    """(class, attr) -> the assignments to `self.<attr>` in that class's methods, and
    (None, attr) -> those to `<anything else>.<attr>`, in statement order."""
    out: Dict[tuple, List[cst.CSTNode]] = {}
    for node in resolver.nodes(cst.AssignTarget) + resolver.nodes(cst.AugAssign) + resolver.nodes(cst.AnnAssign):
        target = node.target
        targets = [el.value for el in target.elements] if isinstance(target, (cst.Tuple, cst.List)) else [target]
        for t in targets:
            if not isinstance(t, cst.Attribute):
                continue
            method = resolver.enclosing_function(node)
            cls = resolver.enclosing_class(node)
            own = (cls is not None and method is not None and method.params.params and isinstance(t.value, cst.Name)
                   and t.value.value == method.params.params[0].name.value)
            out.setdefault((cls if own else None, t.attr.value), []).append(node)
    return out


def holders(resolver, module: cst.Module, is_module_class, foreign=None) -> List[Holder]:
    """The attributes of the script's top-level classes (not nn.Modules) that their
    __init__ sets from a parameter (`self.optimizer = optimizer`); `reassigned` is where
    something else assigns them too (they are then not followed). `foreign(obj, cls)`: the
    object `obj` of an `obj.<attr> = ...` outside the class is surely not an instance of it
    (`C = CfgNode(); C.model = ...` in another function): that assignment does not count."""
    out = []
    assigned = _attribute_assignments(resolver)
    for cls in module.body:
        if not isinstance(cls, cst.ClassDef) or is_module_class(cls.name.value):
            continue
        init = next((s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None)
        if init is None or len(init.params.params) < 2:
            continue
        me = init.params.params[0].name.value
        params = {p.name.value for p in init.params.params[1:]} | {p.name.value for p in init.params.kwonly_params}
        rebound = local_bindings(init) - params - {me}
        for stmt in init.body.body:
            small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
            if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
                continue
            target, value = small.targets[0].target, unwrapped(resolver, small.value)
            if not (isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name)
                    and target.value.value == me and isinstance(value, cst.Name) and value.value in params):
                continue
            attr = target.attr.value
            if any(h.cls is cls and h.attr == attr for h in out):
                continue  # held already: its first assignment
            elsewhere = [n for n in assigned.get((None, attr), [])
                         if foreign is None or not all(foreign(obj, cls) for obj in _objects(n, attr))]
            others = [n for n in assigned.get((cls, attr), []) + elsewhere
                      if n is not small.targets[0] and not _keeps(resolver, n, attr)
                      and not _holds_again(resolver, n, init, value.value)]
            if value.value in rebound:
                others.insert(0, small)
            out.append(Holder(cls, attr, value.value, init, others[0] if others else None))
    return out


def _holds_again(resolver, target: cst.CSTNode, init: cst.FunctionDef, param: str) -> bool:
    """`self.model = DDP(model, device_ids=[gpu_id])` after `self.model = model.to(gpu_id)` in the same
    __init__: the attribute is assigned the same parameter's module again (moved, or in a wrapper the
    migration removes), so it still holds what the constructions hand that parameter."""
    assign = resolver.parent(target) if type(target) is cst.AssignTarget else None
    if type(assign) is not cst.Assign or len(assign.targets) != 1 or resolver.enclosing_function(assign) is not init:
        return False
    value = unwrapped(resolver, assign.value)
    return type(value) is cst.Name and value.value == param


def _objects(node: cst.CSTNode, attr: str) -> List[cst.BaseExpression]:
    """The objects whose `.<attr>` the assignment `node` (an AssignTarget, AugAssign, AnnAssign) sets."""
    target = node.target
    targets = [el.value for el in target.elements] if isinstance(target, (cst.Tuple, cst.List)) else [target]
    return [t.value for t in targets if isinstance(t, cst.Attribute) and t.attr.value == attr]


def _keeps(resolver, target: cst.CSTNode, attr: str) -> bool:
    """`self.model = self.model.to(device)`: an assignment of the attribute that keeps the object
    it holds (a module's `.to()` moves it in place and returns it)."""
    assign = resolver.parent(target) if type(target) is cst.AssignTarget else None
    if type(assign) is not cst.Assign or len(assign.targets) != 1:
        return False
    own = target.target
    return (type(own) is cst.Attribute and type(own.value) is cst.Name
            and keeps_attribute(unwrapped(resolver, assign.value), own.value.value, attr))


def unwrapped(resolver, value: cst.BaseExpression) -> cst.BaseExpression:
    """The module a value is, through placement methods (`model.to(device)`) and the DDP /
    DataParallel wrappers the migration removes (`DDP(self.model, device_ids=[...])` holds
    `self.model`, as `self.model` after the rewrite)."""
    value = module_itself(value)
    while type(value) is cst.Call and resolver.qnames(value) & (DDP | DATA_PARALLEL):
        inner = [a for a in value.args if a.keyword is None and not a.star] or [
            a for a in value.args if a.keyword is not None and a.keyword.value == "module"]
        if not inner:
            break
        value = module_itself(inner[0].value)
    return value


def held_models(resolver, found: List[Holder], names) -> bool:
    """`self.model` in each method of a class whose every construction hands that
    parameter a model of the calling function."""
    changed = False
    for h in found:
        calls = h.constructions(resolver)
        if h.reassigned is not None or not calls or not all(
            isinstance(h.bound(c).get(h.param), cst.Name)
            and h.bound(c)[h.param].value in names.get(resolver.enclosing_function(c), set())
            for c in calls
        ):
            continue
        for method, me in h.methods():
            key = f"{me}.{h.attr}"
            if key not in names.setdefault(method, set()):
                names[method].add(key)
                changed = True
        if h.param not in names.setdefault(h.init, set()):  # the parameter itself, in __init__
            names[h.init].add(h.param)
            changed = True
    return changed


def held_optimizers(resolver, found: List[Holder], names, lost: Lost) -> bool:
    """`self.optimizer` in each method of a class whose every construction hands that
    parameter an optimizer, mapped to the attribute (or the visible variable) holding the
    model it trains; a construction that hands it something else is where it is lost."""
    changed = False
    for h in found:
        seen = []  # (construction, hands an optimizer, the model's holder inside, why it is lost or "")
        for c in h.constructions(resolver):
            arg = h.bound(c).get(h.param)
            known = names.get(resolver.enclosing_function(c), {})
            if not (isinstance(arg, cst.Name) and arg.value in known):
                shown = code(arg) if arg is not None else "nothing"
                seen.append((c, False, None, f"the construction on line {resolver.line(c)} passes {shown} as "
                                             f"`{h.param}`, not the optimizer"))
                continue
            model = known[arg.value]
            attrs = [g.attr for g in found if g.cls is h.cls and isinstance(h.bound(c).get(g.param), cst.Name)
                     and h.bound(c)[g.param].value == model]
            where = ("attr", attrs[0]) if attrs else ("name", model) if model else None
            seen.append((c, True, where, "" if where else
                         f"the model `{arg.value}` trains is not known where {h.cls.name.value} is built"))
        if not any(s[1] for s in seen):
            continue
        wrong = next(((c, why) for c, _, _, why in seen if why), None)
        if h.reassigned is not None:
            wrong = (h.reassigned, f"`{h.attr}` of {h.cls.name.value}, handed the optimizer, is assigned again on "
                                   f"line {resolver.line(h.reassigned)}")
        if wrong is None and len({s[2] for s in seen}) > 1:
            wrong = (seen[-1][0], f"the constructions of {h.cls.name.value} hand `{h.param}` optimizers of "
                                  "different models")
        for method, me in h.methods():
            key = f"{me}.{h.attr}"
            if wrong is not None:
                lost.setdefault((method, key), (wrong[0], wrong[1]))
                continue
            kind, model = seen[0][2]
            inside = f"{me}.{model}" if kind == "attr" else (
                model if same_value(resolver, model, resolver.enclosing_function(seen[0][0]), method) else None)
            if key not in names.setdefault(method, {}):
                names[method][key] = inside
                changed = True
    return changed


def disagreeing_calls(resolver, calls_of, names, lost: Lost) -> None:
    """A parameter holds an optimizer only where every call of its function hands it one,
    training the same model: each other call is where the value is lost."""
    for callee, inside in list(names.items()):
        if callee is None:
            continue
        params = [p.name.value for p in (*callee.params.params, *callee.params.kwonly_params)]
        for param in params:
            if param not in inside:
                continue
            for call in calls_of(callee):
                caller = resolver.enclosing_function(call)
                bound = list(bind_args(callee, call))
                arg = dict(bound).get(param)
                known = names.get(caller, {})
                if not (isinstance(arg, cst.Name) and arg.value in known):
                    shown = code(arg) if arg is not None else "no argument"
                    why = f"the call on line {resolver.line(call)} passes {shown} as `{param}`, not the optimizer"
                elif model_in_callee(resolver, known[arg.value], bound, caller, callee) != inside[param]:
                    why = (f"the call on line {resolver.line(call)} passes an optimizer of another model as "
                           f"`{param}`")
                else:
                    continue
                lost.setdefault((callee, param), (call, why))
                break
