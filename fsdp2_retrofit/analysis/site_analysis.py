"""What each per-site analysis of a script reads: the module, its resolver, the
script's classes, every call, its functions, the value flow and the sharding facts,
computed once.

The analyses (models.py, optimizers.py, loops.py, data.py, logs.py, launch.py) each
find one kind of site on this base; ScriptFacts (facts.py) assembles them for the
rewrite, and `check` (check/lint.py's LintContext) asks the same classes directly:
one analysis for both.
"""
from __future__ import annotations

from functools import cached_property
from typing import Dict, List, Optional, Union

import libcst as cst

from .closures import nested_functions
from .flow import ValueFlow, innermost_call
from .held_values import Holder, holders
from .model_classes import ClassRegistry
from .shard_anchors import ShardAnchors
from fsdp2_retrofit.syntax.names import SELF_RETURNING_METHODS, Resolver, bind_args, is_main_guard
from fsdp2_retrofit.syntax.torch_api import TORCH_COMPILE

Block = Union[cst.IndentedBlock, cst.Module]
Scope = Union[cst.FunctionDef, cst.Module]


class SiteAnalysis:
    """One script's module, resolver, classes and calls, for the methods that find its sites."""

    def __init__(self, module: cst.Module, resolver: Resolver, classes: Optional[ClassRegistry] = None,
                 path: Optional[str] = None):
        self.module = module
        self.r = resolver
        self.classes = classes if classes is not None else ClassRegistry()
        self.path = path
        self.calls: List[cst.Call] = resolver.nodes(cst.Call)

    @property
    def shards(self):
        """What the script shards, where, and which values hold sharded state (analysis/sharding.py:
        the facts `check` asks), built once on this analysis's resolver, functions and value flow."""
        if getattr(self, "_shards", None) is None:
            from .sharding import shard_facts

            self._shards = shard_facts(self)
        return self._shards

    @property
    def flow(self) -> ValueFlow:
        """Which values an expression of the script can hold (analysis/flow.py), made once."""
        if getattr(self, "_flow", None) is None:
            self._flow = ValueFlow(self.r, self._callee, self.calls_of)
        return self._flow

    @cached_property
    def anchors(self) -> ShardAnchors:
        """Where each model's build ends (shard_anchors.py), made once."""
        return ShardAnchors(self)

    def _scope_body(self, stmt):
        """The statement holding `stmt` directly in its function body, the module, or the
        `if __name__ == "__main__":` block, and that block."""
        top = stmt
        for anc in self.r.ancestors(stmt):
            if isinstance(anc, (cst.IndentedBlock, cst.Module)):
                owner = self.r.parent(anc)
                if isinstance(anc, cst.Module) or isinstance(owner, cst.FunctionDef) or is_main_guard(owner):
                    return top, anc
            elif isinstance(anc, cst.BaseCompoundStatement):
                top = anc
        return top, self.r.block_of(stmt)

    def wrapping(self, binding, bindings) -> tuple:
        """The binding of the module that wraps the build `binding` under the same name
        (`model = Net()`, then `model = Wrapper(model)`, Wrapper an nn.Module of the script, a
        sibling module or torch, or a function returning one), when nothing uses the model between
        the two: that module is what the optimizer trains and what fully_shard must see, as if
        built in one expression (`model = Wrapper(Net())`); the inner module is part of it.
        Followed through each such wrap; anything else (a wrapper that is not a module, a use
        before the wrap) keeps `binding`, and the shard blocker refuses the rebinding (FSR620)."""
        by_stmt = {id(b[1]): b for b in bindings}
        seen = set()
        while id(binding[1]) not in seen:
            seen.add(id(binding[1]))
            name, stmt, _ = binding
            top, block = self._scope_body(stmt)
            later = self.anchors.rebound_by(name, top, block) if block is not None and top in block.body else None
            wrap = by_stmt.get(id(later)) if later is not None else None
            if wrap is None or wrap[0] != name or self.anchors.used_before(name, top, later, block) is not None:
                return binding
            binding = wrap
        return binding

    def _module_binding_of(self, name: cst.Name, bindings) -> Optional[tuple]:
        """The one module binding (name, stmt, class) of the script whose module the read `name`
        holds, followed by value (analysis/flow.py: a parameter of a function handed the model by
        every call, an alias, a helper's return); None when some value it can hold is not a module
        the script builds, or when it can hold several."""
        if getattr(self, "_bindings_by_call", None) is None:
            self._bindings_by_call = {}
            for binding in bindings:
                value = binding[1].body[0].value
                if self.r.is_call_to(value, TORCH_COMPILE) and value.args:
                    value = value.args[0].value
                ctor = innermost_call(value)
                if ctor is not None:
                    self._bindings_by_call.setdefault(id(ctor), binding)
                    # a helper that hands back the module it is given (`cuda(Net(), flag)`): the build inside
                    inner = self.handed_back(ctor)
                    if inner is not None:
                        self._bindings_by_call.setdefault(id(innermost_call(inner) or inner), binding)
        found = {}
        for origin in self.flow.values(name):
            ctor = innermost_call(origin) if isinstance(origin, cst.BaseExpression) else None
            binding = self._bindings_by_call.get(id(ctor)) if ctor is not None else None
            if binding is None:
                return None
            found[id(binding[1])] = binding
        if len(found) > 1:
            # `net = Net()`, then `net = Wrapper(net)`: the name holds both (values are not told apart
            # by position), and the wrapper is the module it ends up holding
            outer = {id(self.wrapping(b, bindings)[1]) for b in found.values()}
            if len(outer) == 1 and next(iter(outer)) in found:
                return found[next(iter(outer))]
        return next(iter(found.values())) if len(found) == 1 else None

    def handed_back(self, call: cst.Call) -> Optional[cst.Call]:
        """The call passed to a function of the script that returns one of its parameters as it was handed
        (`cuda(Net(), use_cuda)` with `return tensor.cuda() if uses_cuda else tensor`: through `.to()`-like
        methods and `a if c else b`), at this call: `Net()`; None for anything else. Read at the call, not
        from every call's arguments (`cuda(x, flag)` elsewhere hands back its own)."""
        fn = self._callee(call)
        if fn is None:
            return None
        returned = set()
        for ret in self.r.descendants(fn, cst.Return):
            if self.r.enclosing_function(ret) is not fn:
                continue
            leaves, pending = [], [ret.value]
            while pending:
                value = pending.pop()
                if type(value) is cst.IfExp:
                    pending += [value.body, value.orelse]
                elif (type(value) is cst.Call and type(value.func) is cst.Attribute
                      and value.func.attr.value in SELF_RETURNING_METHODS):
                    pending.append(value.func.value)
                else:
                    leaves.append(value)
            if not all(type(leaf) is cst.Name for leaf in leaves):
                return None
            returned |= {leaf.value for leaf in leaves}
        params = {p.name.value for p in fn.params.params}
        if len(returned) != 1 or not returned <= params:
            return None
        arg = dict(bind_args(fn, call)).get(next(iter(returned)))
        return arg if type(arg) is cst.Call else None

    def _named_assignments(self, stmts, methods: bool = False):
        """(name, stmt, value) for each `name = value` or `name: T = value` line outside
        class bodies; with `methods`, those in the methods of a class that is not an
        nn.Module too (a trainer class building its optimizer in `run()`)."""
        for stmt in stmts:
            if len(stmt.body) != 1:
                continue
            small = stmt.body[0]
            if type(small) is cst.Assign and len(small.targets) == 1:
                target = small.targets[0].target
            elif type(small) is cst.AnnAssign and small.value is not None:
                target = small.target  # `model: nn.Module = Net()`
            else:
                continue
            if isinstance(target, cst.Name) and self.r.enclosing_class(stmt) is None:
                yield target.value, stmt, small.value
            elif methods and self._in_trainer_method(stmt):
                me = self.r.enclosing_function(stmt).params.params[:1]
                if type(target) is cst.Name:
                    yield target.value, stmt, small.value
                elif (type(target) is cst.Attribute and type(target.value) is cst.Name and me
                      and target.value.value == me[0].name.value):
                    yield f"{target.value.value}.{target.attr.value}", stmt, small.value  # self.optimizer = ...

    def _in_each_method(self, fn: Optional[cst.FunctionDef], name: str) -> List[tuple]:
        """(method, `name` as that method spells it) for each method of the class `fn` is a method of, where
        `name` is an attribute of `fn`'s instance (`self.net` built in a Solver's __init__ is `self.net` in
        train(), and `s.net` in a method whose first parameter is `s`); [] where it is not."""
        cls = self.r.enclosing_class(fn) if fn is not None else None
        me = fn.params.params[:1] if fn is not None else []
        if cls is None or not me or not name.startswith(me[0].name.value + "."):
            return []
        rest = name[len(me[0].name.value):]
        return [(method, method.params.params[0].name.value + rest) for method in cls.body.body
                if isinstance(method, cst.FunctionDef) and method.params.params]

    def _in_trainer_method(self, stmt) -> bool:
        """`stmt` is in a method of a top-level class of the script that is not an nn.Module."""
        fn = self.r.enclosing_function(stmt)
        cls = self.r.enclosing_class(fn) if fn is not None else None
        return (cls is not None and self.r.enclosing_function(cls) is None
                and not self.classes.is_module_class(cls.name.value))

    def _local_calls(self):
        """(call, function) for every call of a function of the script by its name: a
        top-level function, or a def nested in the calling function or one around it."""
        if getattr(self, "_local_call_list", None) is None:
            self._local_call_list = [(call, fn) for call in self.calls for fn in [self._callee(call)] if fn is not None]
        return iter(self._local_call_list)

    def calls_of(self, fn: Optional[cst.FunctionDef]) -> List[cst.Call]:
        """The calls by name of the script's function `fn` (_local_calls, grouped once)."""
        if getattr(self, "_calls_by_function", None) is None:
            self._calls_by_function: Dict[int, List[cst.Call]] = {}
            for call, callee in self._local_calls():
                self._calls_by_function.setdefault(id(callee), []).append(call)
        return self._calls_by_function.get(id(fn), []) if fn is not None else []

    def callees(self, call: cst.Call) -> List[tuple]:
        """(function, parameters the call does not pass) for what a call of the script's own code runs: a
        function by its name (0), or the methods of the script's classes `self.method(...)` /
        `obj.method(...)` can run (1: `self`)."""
        fn = self._callee(call)
        return [(fn, 0)] if fn is not None else [(m, 1) for m in self.flow.methods_called(call)]

    def _holders(self) -> List[Holder]:
        """The `self.<attr> = <param>` attributes of the script's classes (held_values.holders), found once."""
        if getattr(self, "_holder_list", None) is None:
            self._holder_list = holders(self.r, self.module, self.classes.is_module_class, self._not_an_instance)
        return self._holder_list

    def _not_an_instance(self, obj: cst.BaseExpression, cls: cst.ClassDef) -> bool:
        """Every value `obj` can hold is made by a call of something imported that is not `cls`
        (`C = CfgNode()`): it is not an instance of the script's class `cls`."""
        origins = self.flow.values(obj)
        for origin in origins:
            if type(origin) is not cst.Call or self._callee(origin) is not None:
                return False
            names = self.r.qnames(origin)
            if not names or any(n.rsplit(".", 1)[-1] == cls.name.value for n in names):
                return False
        return bool(origins)

    def _sibling_function(self, call: cst.Call):
        """(the top-level function, its module's resolver) a call of a function of a project module the
        script imports runs (`set_optimizer(opt, model)` with `from util import set_optimizer`, or
        `util.set_optimizer(...)`), or None."""
        for qname in sorted(self.r.qnames(call.func)):
            namespace, _, name = qname.rpartition(".")
            fn = self.classes.top_level_functions.get(namespace, {}).get(name) if namespace else None
            if fn is not None:
                return fn, self.classes.top_level[namespace][1].resolver
        return None

    def _callee(self, call: cst.Call) -> Optional[cst.FunctionDef]:
        """The function of the script a call by name runs: a def nested in the calling
        function (or one around it), else a top-level function."""
        if type(call.func) is not cst.Name:
            return None
        if getattr(self, "_defs", None) is None:
            self._defs = {(id(outer), inner.name.value): inner for inner, outer in nested_functions(self.r)}
            self._defs.update({(None, s.name.value): s for s in self.module.body if type(s) is cst.FunctionDef})
        name = call.func.value
        scope = self.r.enclosing_function(call)
        while scope is not None:
            found = self._defs.get((id(scope), name))
            if found is not None:
                return found
            scope = self.r.enclosing_function(scope)
        return self._defs.get((None, name))
