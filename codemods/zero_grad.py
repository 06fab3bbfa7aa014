"""zero_grad: clear gradients through the optimizer where `model.zero_grad()` sits
between the model's forward and its backward()."""
from __future__ import annotations

from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.closures import closure_reads, free_reads
from fsdp2_retrofit.analysis.zero_grad import ZeroGradBetween, zero_grads_between
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import root_name

WHY = (
    "after the forward FSDP2 keeps the root's (and the last block's) parameters gathered until backward: "
    "`{model}.zero_grad()` there clears the gathered tensors, not the sharded parameters that hold the "
    "gradients, which then add up step after step; `{opt}` holds the sharded parameters"
)


class ClearThroughOptimizerCommand(RetrofitStage):
    DESCRIPTION = "Replace `model.zero_grad()` between forward and backward() by the optimizer's zero_grad()."
    CODE = "zero_grad"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        r = facts.resolver
        helpers = {f.name.value for f in facts.module.body if isinstance(f, cst.FunctionDef)}

        def model_of(expr, at) -> Optional[str]:
            if not isinstance(expr, cst.Name):
                return None
            return expr.value if expr.value in facts.trained_names.get(_scope(facts, expr.value, at), ()) else None

        founds = zero_grads_between(r, model_of, helpers)
        covered = set()  # the other calls of a group cleared through one optimizer (below)
        for found in founds:
            if id(found.call) in covered:
                continue
            names = facts.optimizer_names.get(_scope(facts, found.model, found.call), {})
            mine = sorted(o for o, m in names.items() if m == found.model)
            shared = sorted(o for o, m in names.items() if m is None)
            where = f"`{code(found.call)}` between the forward (line {r.line(found.forward)}) and backward() " \
                    f"(line {r.line(found.backward)})"
            group = _clears_all_it_trains(facts, found, founds, shared) if not mine and len(shared) == 1 else None
            if group is not None:
                self._clear_group(editor, r, shared[0], group)
                covered.update(id(f.call) for f in group)
                continue
            if len(mine) != 1 or shared:
                candidates = mine + shared
                if not candidates:
                    why = "no optimizer of the script trains it here"
                elif len(candidates) == 1:
                    why = (f"`{candidates[0]}` trains it together with other parameters: its zero_grad() would "
                           "clear more than the model's")
                else:
                    why = (f"{len(candidates)} optimizers may train it here ({', '.join(candidates)}): which one "
                           "clears its gradients is not known")
                self._refuse_without_optimizer(found, where, why)
            opt = mine[0]
            part = _partial(facts, opt, _scope(facts, found.model, found.call))
            if part is not None:
                self._refuse_without_optimizer(found, where, f"`{opt}` is built over part of the model ({part}): "
                                          "its zero_grad() would not clear every gradient the model's clears")
            editor.replace_expression(found.call.func.value, cst.parse_expression(opt))  # `self.optimizer` too
            self.change(
                found.call,
                f"`{found.model}.zero_grad()` -> `{opt}.zero_grad()` (it sits between the forward and backward())",
                WHY.format(model=found.model, opt=opt),
                "the sharded gradients are never cleared: every step adds to the last (wrong weights, no error)",
            )

    def _clear_group(self, editor: StatementEditor, r, opt: str, group: List[ZeroGradBetween]) -> None:
        """`encoder.zero_grad(); decoder.zero_grad()` before backward(), `opt` training exactly
        those models: one `opt.zero_grad()` in place of the first call, the others removed."""
        first, rest = group[0], group[1:]
        editor.replace_expression(first.call.func.value, cst.parse_expression(opt))
        for other in rest:
            editor.replace(r.statement_of(other.call), None)
        models = ", ".join(f"`{f.model}`" for f in group)
        self.change(
            first.call,
            f"{' + '.join(f'`{f.model}.zero_grad()`' for f in group)} -> `{opt}.zero_grad()` (they sit between the "
            "forward and backward(), and clear together every model the optimizer trains)",
            WHY.format(model=group[0].model, opt=opt) + f"; `{opt}` trains {models} and nothing else of a model",
            "the sharded gradients are never cleared: every step adds to the last (wrong weights, no error)",
        )

    def _refuse_without_optimizer(self, found, where: str, why: str) -> None:
        self.refuse(
            "FSR950",
            found.call,
            f"{where} and no one optimizer to clear its gradients through",
            why,
            f"call `{found.model}.zero_grad()` before the forward, or clear through the optimizer that "
            "trains the model (`optimizer.zero_grad()`)",
        )


def _scope(facts: ScriptFacts, name: str, at: cst.CSTNode):
    """The function whose model `name` is at `at`: the function of `at`, or the one
    around it when `name` is a closure variable there."""
    r = facts.resolver
    fn = r.enclosing_function(at)
    while fn is not None and r.enclosing_function(fn) is not None and name in closure_reads(fn):
        fn = r.enclosing_function(fn)
    return fn


def _clears_all_it_trains(facts: ScriptFacts, found: ZeroGradBetween, founds: List[ZeroGradBetween],
                          shared: List[str]) -> Optional[List[ZeroGradBetween]]:
    """The zero_grad() calls before the same backward() that together clear every model the one
    optimizer `shared[0]` trains (`encoder.zero_grad(); decoder.zero_grad()` with one Adam over
    both), each whole model and each a statement of its own; None when they do not."""
    r = facts.resolver
    opt, fn = shared[0], _scope(facts, found.model, found.call)
    sites = [o for o in facts.optimizers if o.name == opt and r.enclosing_function(o.stmt) is fn]
    if not sites and fn is not None and {found.model, opt} <= free_reads(fn):
        # a function of the module reading the module's optimizer and models (`def train(...)`)
        sites = [o for o in facts.optimizers if o.name == opt and r.enclosing_function(o.stmt) is None]
    if len(sites) != 1 or len(sites[0].models) < 2 or _reads_part(r, sites) is not None:
        return None
    trained = set(sites[0].models)
    group = [f for f in founds if f.backward is found.backward and f.model in trained]
    if {f.model for f in group} != trained or len(group) != len(trained):  # each model cleared, once
        return None
    for f in group:
        stmt = r.statement_of(f.call)
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
                and isinstance(stmt.body[0], cst.Expr) and stmt.body[0].value is f.call):
            return None
    return sorted(group, key=lambda f: r.order(f.call))


def _partial(facts: ScriptFacts, opt: str, fn) -> Optional[str]:
    """How an optimizer named `opt` reads its model's parameters when it reads a part
    (`model.head.parameters()`); None when each reads the whole model. The optimizers
    of `fn` with that name, else (received as an argument) every single-model one."""
    r = facts.resolver
    sites = [o for o in facts.optimizers if o.name == opt and r.enclosing_function(o.stmt) is fn]
    sites = sites or [o for o in facts.optimizers if len(o.models) == 1]
    return _reads_part(r, sites)


def _reads_part(r, sites) -> Optional[str]:
    """The first `model.<part>.parameters()` an optimizer site (or the statements feeding it) reads."""
    for site in sites:
        for stmt in [*site.feeders, site.stmt]:
            for call in r.descendants(stmt, cst.Call):
                f = call.func
                if not (isinstance(f, cst.Attribute) and f.attr.value in ("parameters", "named_parameters")):
                    continue
                if isinstance(f.value, (cst.Attribute, cst.Subscript)) and root_name(f.value) in site.models:
                    # model.head, model.blocks[0]
                    return code(call)
    return None
