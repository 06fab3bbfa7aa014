"""Training loops: the for/while loops that call backward(), and the loader each iterates."""
from __future__ import annotations

from typing import List, Optional

import libcst as cst

from .site_analysis import SiteAnalysis
from fsdp2_retrofit.syntax.names import Resolver, iterated_name
from dataclasses import dataclass


@dataclass
class LoopSite:
    node: cst.CSTNode  # For or While that calls backward()
    function: Optional[cst.FunctionDef]
    loader: Optional[str] = None


class LoopAnalysis(SiteAnalysis):
    """Finds the training loops."""

    def _train_loops(self, loops) -> List[LoopSite]:
        """Innermost loops that call backward(), directly or through a per-step helper
        of the script (`train_step(model, batch, optimizer)`, no loop of its own), or a
        per-step method of one of its classes (`self._run_batch(x, y)` of a trainer,
        followed by value: analysis/flow.py).

        Works from the calls up (one walk of ancestors per backward() call), not by
        visiting every loop's body."""
        top = {fn for fn in self.module.body if isinstance(fn, cst.FunctionDef)}
        methods = {m for cls in self.module.body if isinstance(cls, cst.ClassDef)
                   and not self.classes.is_module_class(cls.name.value)
                   for m in cls.body.body if isinstance(m, cst.FunctionDef)}
        backward = [c for c in self.calls if isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward"]
        chains = {id(c): self._loop_chain(c) for c in backward}
        helpers, step_methods = set(), set()
        for fn in top | methods:
            mine = [c for c in backward if chains[id(c)][1] is fn]
            if mine and not any(chains[id(c)][0] for c in mine):
                if fn in top:
                    helpers.add(fn.name.value)
                else:
                    step_methods.add(fn)
        triggers = backward + [c for c in self.calls if type(c.func) is cst.Name and c.func.value in helpers]
        named = {m.name.value for m in step_methods}
        triggers += [c for c in self.calls if type(c.func) is cst.Attribute and c.func.attr.value in named
                     and step_methods.intersection(self.flow.methods_called(c))]
        innermost, outer = set(), set()
        for call in triggers:
            chain = chains[id(call)][0] if id(call) in chains else self._loop_chain(call)[0]
            if chain:
                innermost.add(chain[0])
                outer.update(chain[1:])
        out = []
        for loop in loops:
            if loop in innermost and loop not in outer:
                site = LoopSite(loop, self.r.enclosing_function(loop))
                if isinstance(loop, cst.For):
                    site.loader = iterated_name(loop.iter)
                out.append(site)
        return out

    def _loop_chain(self, call):
        """(the loops whose body holds `call`, innermost first; the nearest enclosing function)."""
        chain, child = [], call
        for anc in self.r.ancestors(call):
            if isinstance(anc, cst.FunctionDef):
                return chain, anc
            if isinstance(anc, (cst.For, cst.While)) and child is anc.body:
                chain.append(anc)
            child = anc
        return chain, None


def train_loops(module: cst.Module, resolver: Resolver) -> List[LoopSite]:
    """The loops of a script that call backward() (directly or through its functions)."""
    return LoopAnalysis(module, resolver)._train_loops(resolver.nodes(cst.For) + resolver.nodes(cst.While))


def steps_outside_loops(resolver: Resolver, optimizer_names) -> List[cst.Call]:
    """`optimizer.step()` calls of the given optimizers (names per function, as
    ScriptFacts.optimizer_names) that no loop repeats: at module level or in a function
    that runs once (called, and never from inside a loop, directly or through its callers).
    A step in a function the script never calls is left out (its caller is unknown)."""
    found = []
    for call in resolver.nodes(cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "step" and isinstance(func.value, cst.Name)):
            continue
        function = resolver.enclosing_function(call)
        if func.value.value not in optimizer_names.get(function, {}):
            continue
        if not _in_loop(resolver, call) and _runs_once(resolver, function, set()):
            found.append(call)
    return found


def _in_loop(resolver: Resolver, node) -> bool:
    """Inside a for/while body (or a comprehension) of its own function."""
    for anc in resolver.ancestors(node):
        if isinstance(anc, cst.FunctionDef):
            return False
        if isinstance(anc, (cst.For, cst.While, cst.CompFor)):
            return True
    return False


def _runs_once(resolver: Resolver, function, seen: set) -> bool:
    if function is None:
        return True
    if function in seen:
        return False  # recursion
    seen = seen | {function}
    name = function.name.value
    callers = [c for c in resolver.nodes(cst.Call)
               if (isinstance(c.func, cst.Name) and c.func.value == name)
               or (isinstance(c.func, cst.Attribute) and c.func.attr.value == name)]
    return bool(callers) and all(
        not _in_loop(resolver, c) and _runs_once(resolver, resolver.enclosing_function(c), seen) for c in callers
    )
