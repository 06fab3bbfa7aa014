"""The names that hold each model, per function of the script.

A model built as `model` in main() is `net` in train(net) (a parameter every call hands
it), `raw_model` after `raw_model = model.module if ddp else model`, the names a helper's
caller assigns its return to, a global a top-level function reads, a closure's free name
and `self.model` in a trainer's methods: the stages rewrite each of them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set

import libcst as cst

from .closures import closure_propagate
from .held_values import held_models
from .returns import names_out
from fsdp2_retrofit.syntax.names import alias_target, assigned_names, bind_args, module_itself, names_in, \
    parameter_names, walk


class ModelNames:
    """Model names per function, on one analysis (site_analysis.SiteAnalysis: its resolver, calls of
    the script's functions and attribute holders); its plain assignments are read once."""

    def __init__(self, site) -> None:
        self.site = site
        self.r = site.r
        self._plain_assignment_list: Optional[List[tuple]] = None

    def of(self, models) -> Dict[Optional[cst.FunctionDef], Set[str]]:
        """Model names per function, following calls that pass a model as an argument and
        nested functions that read one of the function around them (a closure)."""
        names: Dict[Optional[cst.FunctionDef], Set[str]] = {}
        for m in models:
            held = self.site._in_each_method(self.r.enclosing_function(m.stmt), m.name)
            if held:  # `self.net = Net()` in a trainer class's method: `self.net` in each of its methods
                for method, name in held:
                    names.setdefault(method, set()).add(name)
                continue
            # `ema.module` (an AveragedModel's copy) is sharded; `ema` is the model the script uses
            names.setdefault(self.r.enclosing_function(m.stmt), set()).add(m.name.split(".", 1)[0])
        changed = True
        while changed:
            changed = False
            for call, callee in self.site._local_calls():
                known = names.get(self.r.enclosing_function(call), set())
                for param in _params_receiving(callee, call, known):
                    if param not in names.setdefault(callee, set()):
                        names[callee].add(param)
                        changed = True
            changed |= self._add_globals(names)
            changed |= self._add_aliases(names)
            changed |= self._add_returns(names)
            changed |= closure_propagate(self.r, names)
            changed |= held_models(self.r, self.site._holders(), names)
        return names

    def _add_returns(self, names) -> bool:
        """`model, optimizer = build(cfg)`: a helper that returns its model hands it to
        the names its caller assigns."""
        changed = False
        for call, callee in self.site._local_calls():
            inside = names.get(callee)
            if not inside:
                continue
            out = set(names_out(self.r, call, callee, inside))
            caller = names.setdefault(self.r.enclosing_function(call), set())
            if out - caller:
                caller |= out
                changed = True
        return changed

    def _add_globals(self, names) -> bool:
        """A model built at the module's top level is the same model in the functions of the
        module's scope that read it as a global (`def test(epoch): ... net.state_dict()`, a
        callback defined under `if __name__ == "__main__":`)."""
        top = names.get(None, set())
        changed = False
        if not top:
            return changed
        for fn in self.r.nodes(cst.FunctionDef):
            if self.r.enclosing_function(fn) is not None or self.r.enclosing_class(fn) is not None:
                continue
            local = parameter_names(fn) | {n for node in walk(fn.body) if isinstance(node, cst.SimpleStatementLine)
                                           for n in assigned_names(node)}
            declared = {n.name.value for node in walk(fn.body) if isinstance(node, cst.Global) for n in node.names}
            seen = names_in(fn.body)
            found = {n for n in top if n in seen and (n not in local or n in declared)}
            if found - names.get(fn, set()):
                names.setdefault(fn, set()).update(found)
                changed = True
        return changed

    def _add_aliases(self, names) -> bool:
        """`raw_model = model`, `raw_model = model.module if ddp else model`: another name
        for the same model, in the same function."""
        changed = False
        for function, alias, value in self._plain_assignments():
            known = names.get(function)
            if known and alias not in known and _aliases_model(value, known):
                known.add(alias)
                changed = True
        return changed

    def _plain_assignments(self) -> List[tuple]:
        """(function, name, value) of each `name = value` statement (one target, a plain
        name), in source order; found once per analysis (of() asks each round)."""
        found = self._plain_assignment_list
        if found is None:
            found = self._plain_assignment_list = []
            for stmt in self.r.nodes(cst.SimpleStatementLine):
                if len(stmt.body) != 1 or type(stmt.body[0]) is not cst.Assign:
                    continue
                assign = stmt.body[0]
                if len(assign.targets) != 1:
                    continue
                target, value = assign.targets[0].target, assign.value
                if type(target) is cst.Name:
                    found.append((self.r.enclosing_function(stmt), target.value, value))
                elif type(target) is type(value) is cst.Tuple and len(target.elements) == len(value.elements) and all(
                        type(t) is type(v) is cst.Element and type(t.value) is cst.Name
                        for t, v in zip(target.elements, value.elements)):
                    # `model, config = self.model, self.config`: each name its own element
                    function = self.r.enclosing_function(stmt)
                    found.extend((function, t.value.value, v.value) for t, v in zip(target.elements, value.elements))
        return found


def _aliases_model(expr, known: Set[str]) -> bool:
    """`model`, `model.module`, `model._orig_mod`, `model.to(device)` (the module itself),
    or a conditional choosing one of them."""
    if isinstance(expr, cst.IfExp):
        return _aliases_model(expr.body, known) or _aliases_model(expr.orelse, known)
    if alias_target(expr) in known:
        return True
    held = module_itself(expr)  # `model = self.model` in a trainer's method holding it
    return (type(held) is cst.Attribute and type(held.value) is cst.Name
            and f"{held.value.value}.{held.attr.value}" in known)


def _params_receiving(fn: cst.FunctionDef, call: cst.Call, known: Set[str]):
    for param, arg in bind_args(fn, call):
        if isinstance(arg, cst.Name) and arg.value in known:
            yield param
