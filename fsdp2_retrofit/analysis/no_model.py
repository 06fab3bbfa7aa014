"""Why no trained model was found: the construct the analysis did not understand, and where.

When no optimizer trains a model built in the script, the shard stage refuses the file.
A refusal at line 1 that says only that tells the user nothing; this analysis looks
for what the script most likely meant and names it at its own line:

- an optimizer of torch.optim whose parameters come from a name bound by something the
  analysis does not recognise as building an nn.Module (`model = get_model(cfg)`
  with get_model imported, `model = registry[name]()`), or from a name never bound
  in the script (a function parameter, an import);
- a call handed `something.parameters()` that is not a torch.optim optimizer
  (`bnb.optim.AdamW8bit(model.parameters())`, `MyOptimizer(model.parameters())`), or a
  wrapper around a torch optimizer built inline whose __init__ does not keep it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import libcst as cst

from .shard_anchors import _is_placement_chain
from fsdp2_retrofit.syntax.names import SELF_RETURNING_METHODS, alias_target, bind_args, calls_in, code, root_name
from fsdp2_retrofit.syntax.torch_api import is_optimizer_call


@dataclass(frozen=True)
class NoModelBlocker:
    at: Union[cst.CSTNode, int]  # the node (or line) the refusal points at
    detail: str  # what was not understood there


def _short(node: cst.CSTNode, limit: int = 60) -> str:
    text = " ".join(code(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _binding(r, name: str, before: cst.CSTNode) -> Optional[cst.SimpleStatementLine]:
    """The last `name = value` (or `name: T = value`) of the scope of `before`, ahead of it."""
    scope = r.enclosing_function(before)
    found = None
    for stmt in r.nodes(cst.SimpleStatementLine):
        if r.order(stmt) >= r.order(before) or r.enclosing_function(stmt) is not scope:
            continue
        small = stmt.body[0] if len(stmt.body) == 1 else None
        targets = (
            [t.target for t in small.targets] if isinstance(small, cst.Assign)
            else [small.target] if isinstance(small, cst.AnnAssign) and small.value is not None else []
        )
        if any(isinstance(t, cst.Name) and t.value == name for t in targets):
            found = stmt
    return found


def _construction(r, name: str, before: cst.CSTNode) -> Optional[cst.SimpleStatementLine]:
    """The last binding of `name` ahead of `before` that is not a move or cast of the
    module itself (`net = net.to(device)`, `G = G.cuda()`: nn.Module.to returns self):
    the statement that builds what the name holds; else the last binding."""
    last = _binding(r, name, before)
    while last is not None and _is_placement_chain(last.body[0].value, name):
        earlier = _binding(r, name, last)
        if earlier is None:
            break
        last = earlier
    return last


def _handed_binding(facts, param: str, before: cst.CSTNode):
    """(the caller's name, the function, the statement binding that name) where `param` is a parameter of
    the function holding `before` and the one call of that function hands it a name the caller binds (by
    value through the program: a linked project's `engine.run(model)` reads as `run(model)`)."""
    r = facts.resolver
    fn = r.enclosing_function(before)
    if fn is None or facts.analysis is None or param not in {p.name.value for p in fn.params.params}:
        return None
    calls = facts.analysis.calls_of(fn)
    if len(calls) != 1:
        return None
    arg = next((a for p, a in bind_args(fn, calls[0]) if p == param), None)
    if not isinstance(arg, cst.Name):
        return None
    bound = _construction(r, arg.value, r.statement_of(calls[0]))
    return None if bound is None else (arg.value, fn, bound)


def _parameters_owner(arg: cst.BaseExpression) -> Optional[str]:
    """`model.parameters()` / `model.named_parameters()` / `model.head.parameters()`: model."""
    for call in calls_in(arg):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters"):
            return root_name(func.value)
    return None


def _model_method(r, node) -> Optional[cst.FunctionDef]:
    """The method of a class holding `node` when it reads its own `self.parameters()` /
    `self.named_parameters()` (a model's `configure_optimizers`)."""
    cls = r.enclosing_class(node)
    method = r.enclosing_function(node)
    if cls is None or method is None:
        return None
    own = any(
        isinstance(c.func, cst.Attribute) and c.func.attr.value in ("parameters", "named_parameters")
        and root_name(c.func.value) == "self"
        for c in calls_in(method)
    )
    return method if own else None


def _method_caller_blocker(r, method: cst.FunctionDef, stmt) -> Optional[NoModelBlocker]:
    """`optimizer = model.configure_optimizers(...)` outside the class, where `model` (or
    the model an alias `raw_model = model.module if ddp else model` names) is bound by
    something not recognised as building an nn.Module: that binding."""
    cls = r.enclosing_class(method)
    for call in r.nodes(cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == method.name.value
                and isinstance(func.value, cst.Name) and r.enclosing_class(call) is not cls):
            continue
        name, seen = func.value.value, set()
        while name not in seen:
            seen.add(name)
            bound = _first_binding(r, name, call)
            if bound is None:
                return NoModelBlocker(
                    call,
                    f"`{_short(call)}` builds the optimizer from `{name}`'s parameters "
                    f"({cls.name.value}.{method.name.value}, line {r.line(stmt)}), but `{name}` is not built in "
                    "this function (a parameter, a global or an import)",
                )
            value = bound.body[0].value
            alias = alias_target(value)
            if alias is None:
                return NoModelBlocker(
                    bound,
                    f"`{name}` (whose {method.name.value}() at line {r.line(call)} builds the optimizer at line "
                    f"{r.line(stmt)}) is bound by `{_short(value)}`, not recognised as building an nn.Module",
                )
            name = alias
    return None


def _first_binding(r, name: str, before: cst.CSTNode) -> Optional[cst.SimpleStatementLine]:
    """The first `name = value` of the scope of `before`, ahead of it, that does not read
    `name` itself (`model = DDP(model)`, `model = torch.compile(model)` rebind it)."""
    scope = r.enclosing_function(before)
    for stmt in r.nodes(cst.SimpleStatementLine):
        if r.order(stmt) >= r.order(before) or r.enclosing_function(stmt) is not scope:
            continue
        small = stmt.body[0] if len(stmt.body) == 1 else None
        if not (isinstance(small, cst.Assign) and len(small.targets) == 1
                and isinstance(small.targets[0].target, cst.Name) and small.targets[0].target.value == name):
            continue
        if (alias_target(small.value) is None or type(small.value) is cst.Call) and _reads(small.value, name):
            continue
        return stmt
    return None


def _reads(expr, name: str) -> bool:
    """Whether `expr` reads the variable `name` (not an attribute of that name: `args.model`)."""
    found = []

    class _R(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            node.value.visit(self)
            return False

        def visit_Name(self, node: cst.Name) -> None:
            found.append(node.value == name)

    expr.visit(_R())
    return any(found)


def no_model_blocker(facts) -> Optional[NoModelBlocker]:
    """The first construct that explains why no trained model was found, or None."""
    r = facts.resolver
    assigned = [
        (stmt, stmt.body[0].value) for stmt in r.nodes(cst.SimpleStatementLine)
        if len(stmt.body) == 1 and isinstance(stmt.body[0], (cst.Assign, cst.AnnAssign))
        and isinstance(stmt.body[0].value, cst.Call) and stmt.body[0].value.args
    ]
    for call in r.nodes(cst.Call):  # `def configure_optimizers(self, ...)` of a model class: who calls it?
        if not is_optimizer_call(r, call):
            continue
        method = _model_method(r, call)
        blocker = _method_caller_blocker(r, method, r.statement_of(call)) if method is not None else None
        if blocker is not None:
            return blocker
    optimizers = []  # (statement, torch optimizer call): assigned, or built inline in a wrapper's arguments
    for stmt, call in assigned:
        inner = next((a.value for a in call.args if isinstance(a.value, cst.Call) and is_optimizer_call(r, a.value)),
                     None)
        if is_optimizer_call(r, call):
            optimizers.append((stmt, call, None))
        elif inner is not None and inner.args and not any(q.startswith("torch.") for q in r.qnames(call)):
            optimizers.append((stmt, inner, call))
    functions = {}  # name -> the script's defs of that name (top level or nested)
    for fn in r.nodes(cst.FunctionDef):
        functions.setdefault(fn.name.value, []).append(fn)
    for stmt, call in assigned:  # `opt = make_optimizer(model, lr)` of a function the analysis did not follow
        if type(call.func) is not cst.Name:
            continue
        for fn in functions.get(call.func.value, []):
            built = [c for c in calls_in(fn) if is_optimizer_call(r, c)]
            if built and _in_returned_tuple(r, built[0]):
                return NoModelBlocker(
                    built[0],
                    f"{fn.name.value}() builds the optimizer `{_short(built[0])}` inside the tuple it returns: the "
                    "rewrite follows a helper's model and optimizer when each is bound to a name before the "
                    "`return` (`optimizer = ...`, then `return model, optimizer`)",
                )
            if built:
                return NoModelBlocker(
                    call,
                    f"`{_short(call)}` builds the optimizer in {fn.name.value}() (`{_short(built[0])}`, line "
                    f"{r.line(built[0])}), which the rewrite does not follow: it follows a function that returns "
                    "the one torch optimizer it builds from the parameters of a model it is handed (or closes "
                    "over) and does nothing else with that model (no .to(), requires_grad_, attribute assignment)",
                )
    for stmt, call, wrapper in optimizers:  # an optimizer of torch.optim: what does it train?
        first = call.args[0].value
        name = _parameters_owner(first) or (first.value if isinstance(first, cst.Name) else None)
        if wrapper is not None and name in facts.module_ctor_names:
            return NoModelBlocker(
                wrapper,
                f"`{_short(wrapper.func)}(...)` holds the optimizer `{_short(call.func)}(...)`, but its __init__ does "
                "not keep that argument as `self.<name>`: what it does with the optimizer is unknown",
            )
        if name is None:
            return NoModelBlocker(call, f"the optimizer's parameters `{_short(first)}` do not name a model")
        bound = _construction(r, name, stmt)
        if bound is None:
            handed = _handed_binding(facts, name, stmt)
            if handed is not None:  # `run(model)` with `model = get_model(...)` at its one call
                caller_name, fn, bound = handed
                return NoModelBlocker(
                    bound,
                    f"`{caller_name}` (handed to {fn.name.value}() as `{name}`, which the optimizer at line "
                    f"{r.line(stmt)} trains) is bound by `{_short(bound.body[0].value)}`, not recognised as building "
                    "an nn.Module" + _star_note(facts, bound.body[0].value),
                )
            return NoModelBlocker(
                call,
                f"the optimizer trains `{name}`, which is not built in this function "
                "(a parameter, a global or an import)",
            )
        return NoModelBlocker(
            bound,
            f"`{name}` (trained by the optimizer at line {r.line(stmt)}) is bound by "
            f"`{_short(bound.body[0].value)}`, not recognised as building an nn.Module"
            + _star_note(facts, bound.body[0].value),
        )
    for stmt, call in assigned:  # `opt = SomeOptimizer(model.parameters())` outside torch.optim
        owner = _parameters_owner(call.args[0].value)
        if owner is not None and not any(q.startswith("torch.") or q.startswith("builtins.") for q in r.qnames(call)):
            return NoModelBlocker(
                call,
                f"`{_short(call.func)}(...)` is given `{owner}`'s parameters but is not a torch.optim optimizer",
            )
    return None


def unrecognised_trained_model(facts) -> Optional[NoModelBlocker]:
    """A name whose parameters a torch.optim optimizer takes (`opt(G.parameters())`,
    `opt(chain(G.parameters(), F.parameters()))`) while the analysis found other models
    but not this one: it is bound in the optimizer's function by a call not recognised as
    building an nn.Module (a class a star import may bind from two places, a factory of
    a library). Left alone it would stay a plain module on every rank, its gradients
    never reduced: the ranks would drift apart. None when every such name is a model."""
    r = facts.resolver
    if not facts.models:
        return None  # no_model_blocker explains that case
    for stmt in r.nodes(cst.SimpleStatementLine):
        small = stmt.body[0] if len(stmt.body) == 1 else None
        call = small.value if isinstance(small, (cst.Assign, cst.AnnAssign)) else None
        if not isinstance(call, cst.Call) or not call.args or not is_optimizer_call(r, call):
            continue
        known = facts.model_names.get(r.enclosing_function(stmt), set())
        for inner in calls_in(call.args[0].value):
            func = inner.func
            if not (isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters")):
                continue
            name = root_name(func.value)
            if name is None or name in known:
                continue
            bound = _construction(r, name, stmt)
            value = bound.body[0].value if bound is not None else None
            built = _built_by(value)
            if built is None:
                continue  # not bound by a call here (a parameter, an attribute of a model): not judged
            return NoModelBlocker(
                bound,
                f"`{name}` (trained by the optimizer at line {r.line(stmt)}) is bound by "
                f"`{_short(value)}`, not recognised as building an nn.Module" + _star_note(facts, value),
            )
    return None


def _built_by(value) -> Optional[cst.Call]:
    """The constructor or factory call of `X(...)`, `X(...).to(d)`, `pkg.make(...)`;
    None for anything else (`name.to(d)` of a name, an attribute, a subscript)."""
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) \
            and value.func.attr.value in SELF_RETURNING_METHODS and isinstance(value.func.value, cst.Call):
        value = value.func.value
    if not isinstance(value, cst.Call) or not isinstance(value.func, (cst.Name, cst.Attribute)):
        return None
    if isinstance(value.func, cst.Attribute) and value.func.attr.value in SELF_RETURNING_METHODS:
        return None
    return value


def _star_note(facts, value) -> str:
    """Why the callee of `value` is unresolved, when a star import is the reason."""
    star = getattr(facts.classes, "star", None)
    call = _built_by(value)
    if star is None or call is None or not isinstance(call.func, cst.Name):
        return ""
    why = star.why_unresolved(call.func.value)
    return f" ({why})" if why else ""


def _in_returned_tuple(r, call: cst.Call) -> bool:
    """`return model, torch.optim.AdamW(...)`: `call` is an element of a returned tuple."""
    element, tup = r.parent(call), r.parent(r.parent(call))
    return type(element) is cst.Element and type(tup) is cst.Tuple and type(r.parent(tup)) is cst.Return


__all__ = ["NoModelBlocker", "no_model_blocker", "unrecognised_trained_model"]


def nothing_found_at(facts) -> NoModelBlocker:
    """Where a refusal that found no trained model points when no_model_blocker names no
    construct: the first module the script builds, which no optimizer is built from (FSR612:
    `model = nn.Sequential(...)` updated by hand, `param.data -= lr * param.grad`); with no
    module, the first optimizer (it trains tensors, not a module's parameters), else the first
    `.backward()` (FSR611: raw tensors trained by hand); line 1 only when none of them is there."""
    r = facts.resolver
    if facts.module_builds:
        name, stmt = min(facts.module_builds, key=lambda b: r.line(b[1]))
        return NoModelBlocker(
            stmt, f"`{name}` is built here, and no torch.optim optimizer is built from its parameters"
        )
    calls = sorted(r.nodes(cst.Call), key=r.line)
    optimizer = next((c for c in calls if is_optimizer_call(r, c)), None)
    if optimizer is not None:
        return NoModelBlocker(
            optimizer, f"`{_short(optimizer)}` trains tensors that are not the parameters of an nn.Module"
        )
    backward = next(
        (c for c in calls if isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward"), None
    )
    if backward is not None:
        return NoModelBlocker(
            backward, f"`{_short(backward)}` trains tensors here, not the parameters of an nn.Module"
        )
    lookup = next((c for c in calls if _looked_up_by_name(r, c)), None)
    if lookup is not None:
        stmt = r.statement_of(lookup)
        shown = stmt.body[0] if type(stmt) is cst.SimpleStatementLine and len(stmt.body) == 1 else lookup
        return NoModelBlocker(
            lookup, f"`{_short(shown)}` picks what the script runs by a name known only when it "
            "runs: the class or function that builds and trains the model cannot be read before then (import it "
            "by its name, or run rewrite on the module that builds the model and its optimizer)"
        )
    return NoModelBlocker(1, "")


def _looked_up_by_name(r, call: cst.Call) -> bool:
    """`globals()[name]`, `vars(mod)[name]`, `getattr(mod, name)` with a name that is no string literal,
    `importlib.import_module(name)`, `__import__(name)`: the code a script runs, chosen at run time."""
    qnames = r.qnames(call.func)
    if qnames & {"builtins.globals", "builtins.locals", "builtins.vars"}:
        parent = r.parent(call)
        return type(parent) is cst.Subscript and parent.value is call
    if "builtins.getattr" in qnames:
        return len(call.args) >= 2 and type(call.args[1].value) is not cst.SimpleString
    return bool(qnames & {"importlib.import_module", "builtins.__import__"})
