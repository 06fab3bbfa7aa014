"""Optimizers: where each is built, from which models' parameters (param groups and
the statements that feed them included), and the names that hold them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import libcst as cst

from .closures import closure_propagate, local_bindings
from .held_values import Lost, disagreeing_calls, global_optimizers, held_optimizers, model_in_callee
from .optimizer_factories import changes_tensors, returned_optimizer
from .returns import names_out
from .site_analysis import Block, SiteAnalysis
from fsdp2_retrofit.syntax.names import (
    Resolver, alias_target, assigned_names, bind_args, calls_in, instance_attribute, root_name, walk,
)
from fsdp2_retrofit.syntax.torch_api import (  # noqa: F401  (FLATTENING_OPTIMIZERS: the shard stage imports it from here)
    FLATTENING_OPTIMIZERS,
    OPTIMIZER_BASES,
    is_optimizer_call,
)


@dataclass
class OptimizerSite:
    name: str
    stmt: cst.SimpleStatementLine
    block: Block
    models: List[str]
    # statements before it that turn the models' parameters into its argument (param groups)
    feeders: List[cst.SimpleStatementLine] = field(default_factory=list)
    call: Optional[cst.Call] = None
    own_class: Optional[cst.ClassDef] = None  # an optimizer class written in the script
    # `ScheduledOptim(optim.Adam(model.parameters()), ...)`: the call of a user class that
    # holds the torch optimizer built inline as its argument (`name` is the wrapper), and
    # the wrapper's attribute that keeps it (`_optimizer`, from its __init__)
    wrapper: Optional[cst.Call] = None
    inner: Optional[str] = None
    # `model.configure_optimizers(...)`: the model's method that builds it from its own parameters
    method: Optional[cst.FunctionDef] = None
    method_builds: frozenset = frozenset()  # qualified names of the calls it makes (the optimizers it may build)


class OptimizerAnalysis(SiteAnalysis):
    """Finds the optimizers and the models they train."""

    def _optimizers(self, stmts, bindings) -> List[OptimizerSite]:
        module_names = {b[0] for b in bindings}
        own = self._own_optimizer_classes()
        out = []
        for target, stmt, call in self._named_assignments(stmts, methods=True):
            if not isinstance(call, cst.Call):
                continue
            own_class = own.get(call.func.value) if isinstance(call.func, cst.Name) else None
            is_torch_optim = self._is_torch_optimizer(call) or own_class is not None
            receiver = root_name(call.func) if isinstance(call.func, cst.Attribute) else None
            feeders: List[cst.SimpleStatementLine] = []
            wrapper, inner, method, builds = None, None, None, frozenset()
            if not is_torch_optim and not isinstance(call.func, cst.Attribute):
                found = self._wrapped_optimizer(call)
                if found is not None:
                    wrapper, call, inner = call, found[0], found[1]
                    is_torch_optim = True
            if is_torch_optim:
                params = [a for a in call.args if (a.keyword is None and not a.star) or (
                    a.keyword is not None and a.keyword.value == "params")][:1]
                names = _ordered_names(params)
                models = self._fed_models(names, stmt, module_names | self._held_modules(stmt, names, module_names,
                                                                                        bindings), feeders)
            elif type(call.func) is cst.Name or self._sibling_function(call) is not None:
                factory = self._optimizer_factory(call, module_names, bindings)
                if factory is None:
                    continue
                method, models, builds = factory  # `opt = make_optimizer(model, lr)`, `util.set_optimizer(...)`
            else:
                if not isinstance(call.func, cst.Attribute):
                    continue
                model, binding = self._model_of_receiver(receiver, stmt, module_names), None
                if model is None and type(call.func.value) is cst.Name:  # `model = self.model` in a trainer's run()
                    binding = self._module_binding_of(call.func.value, bindings)
                    model = receiver if binding is not None else None
                if model is None:
                    continue
                method = self._optimizer_method(model, call.func.attr.value, stmt, bindings, binding)
                if method is None:
                    continue
                models = [model]  # model.configure_optimizers(...), raw_model.configure_optimizers(...)
                method, builds = method or (None, frozenset())  # False: a class that is not readable
            block = self.r.block_of(stmt)
            out.append(
                OptimizerSite(target, stmt, block, models, feeders, call, own_class, wrapper, inner, method)
            )
            if method is not None:
                out[-1].method_builds = builds
        return out

    def _held_modules(self, stmt, names, module_names, bindings) -> Set[str]:
        """Those of `names` (read by the optimizer's parameters in `stmt`) that hold a module the
        script builds, whatever they are called there (a parameter handed the model, an alias):
        followed by value. Attribute parts (`.parameters`) and known module names are not asked."""
        wanted = set(names) - module_names
        if not wanted:
            return set()
        skip = {id(a.attr) for a in walk(stmt) if type(a) is cst.Attribute}
        held = {n.value for n in walk(stmt) if type(n) is cst.Name and n.value in wanted and id(n) not in skip
                and self._module_binding_of(n, bindings)}
        # `self.model.parameters()` in a trainer's method: the attribute, followed by value to the build
        held |= {instance_attribute(a) for a in walk(stmt)
                 if instance_attribute(a) in wanted and self._module_binding_of(a, bindings)}
        return held

    def _is_torch_optimizer(self, call: cst.Call) -> bool:
        return is_optimizer_call(self.r, call)

    def _wrapped_optimizer(self, call: cst.Call):
        """(the torch optimizer, the attribute that keeps it) for `Wrapper(optim.Adam(...), ...)`,
        not a call of torch's (an lr scheduler is not a wrapper): a class of the script or of a
        sibling module whose __init__ stores that argument as `self.<attr> = <param>`, or a
        class that cannot be read (attribute None: the shard stage says so, and refuses a
        state dict saved through an attribute of it). None for a class read that keeps it
        some other way."""
        if any(q.startswith("torch.") for q in self.r.qnames(call)):
            return None
        for arg in call.args:
            if arg.star or not isinstance(arg.value, cst.Call) or not self._is_torch_optimizer(arg.value):
                continue
            info = next((self.classes.get(q) for q in sorted(self.r.qnames(call)) if self.classes.get(q)), None)
            if info is None:
                return arg.value, None
            attr = self._wrapper_attribute(info, call, arg)
            return (arg.value, attr) if attr is not None else None
        return None

    def _wrapper_attribute(self, info, call: cst.Call, arg: cst.Arg) -> Optional[str]:
        init = info.methods.get("__init__")
        if init is None:
            return None
        params = [p.name.value for p in init.params.params][1:]  # after self
        if arg.keyword is not None:
            param = arg.keyword.value
        else:
            index = [a for a in call.args if a.keyword is None and not a.star].index(arg)
            param = params[index] if index < len(params) else None
        if param is None:
            return None
        for stmt in init.body.body:
            small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
            if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
                continue
            target = small.targets[0].target
            if (isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name)
                    and target.value.value == "self" and isinstance(small.value, cst.Name)
                    and small.value.value == param):
                return target.attr.value
        return None

    def _optimizer_factory(self, call: cst.Call, module_names, bindings=()):
        """(the function, the models, the qualified names of its calls) for a call of a
        function of the script (top level, or nested and found by lexical scope) that
        returns the one torch optimizer it builds, from the parameters of models it is
        handed (`make_optimizer(model, lr)`) or closes over, and does nothing else with
        them: only `<model>[.<part>].parameters()` / `.named_parameters()` (param groups
        included). Built when it is called: after fully_shard, from the sharded
        parameters. None for anything else."""
        fn, resolver = self._callee(call), self.r
        if fn is None:  # a function of a project module the script imports (`from util import set_optimizer`)
            fn, resolver = self._sibling_function(call) or (None, None)
        if fn is None or changes_tensors(fn) or returned_optimizer(
                fn, self._is_torch_optimizer if resolver is self.r else lambda c: is_optimizer_call(resolver, c)) is None:
            return None
        readers = {}  # model name in fn -> ids of its Name nodes that only read parameters
        for c in calls_in(fn):
            if isinstance(c.func, cst.Attribute) and c.func.attr.value in ("parameters", "named_parameters", "modules", "named_modules"):
                root = c.func.value
                while type(root) is cst.Attribute:
                    root = root.value
                if type(root) is cst.Name:
                    readers.setdefault(root.value, set()).add(id(root))
        if not readers:
            return None
        params = {p.name.value for p in fn.params.params} | {p.name.value for p in fn.params.kwonly_params}
        passed = dict(bind_args(fn, call))
        models = []
        local = local_bindings(fn) - params
        for name, ids in readers.items():
            if name in local:
                continue  # `for mn, m in model.named_modules(): m.named_parameters()`: a part of a model read above
            uses = [n for n in walk(fn.body) if type(n) is cst.Name and n.value == name]
            if any(id(n) not in ids for n in uses):
                return None  # the model is used otherwise (moved, frozen, called): not only read
            if name in params:
                arg = passed.get(name)
                model = arg.value if type(arg) is cst.Name else None
                # the module the argument holds, followed by value (not a name another function happens to bind)
                if model is not None and not self._module_binding_of(arg, bindings):
                    return None
            else:
                model = name  # a model of the function around it (a closure) or a global
                if model not in module_names or resolver is not self.r:
                    return None
            if model is None:
                return None
            if model not in models:
                models.append(model)
        return fn, models, frozenset(q for c in calls_in(fn) for q in resolver.qnames(c))

    def _model_of_receiver(self, receiver: Optional[str], stmt, module_names) -> Optional[str]:
        """The model `receiver` names: itself, or the model it was bound to earlier in the
        same block (`raw_model = model`, `raw_model = model.module if ddp else model`)."""
        if receiver is None or receiver in module_names:
            return receiver
        block = self.r.block_of(stmt)
        body = list(block.body) if block is not None else []
        earlier = body[: body.index(stmt)] if stmt in body else []
        for source, value in _sources_of(receiver, earlier):
            model = alias_target(value)
            if model in module_names:
                return model
        return None

    def _optimizer_method(self, model: str, attr: str, stmt, bindings, binding=None):
        """(the model class's method `attr`, the qualified names of its calls) when it builds
        a torch optimizer and reads the model's own parameters (`self.parameters()`,
        `self.named_parameters()`: param groups built from them are this model's); False
        when the class is not readable and the method's name says optimizer
        (`configure_optimizers`); None otherwise."""
        scope = self.r.enclosing_function(stmt)
        cls = binding[2] if binding is not None else next(
            (b[2] for b in bindings if b[0] == model and self.r.enclosing_function(b[1]) is scope), None)
        info = self.classes.get(cls)
        if info is None or attr not in info.methods:
            return False if "optim" in attr.lower() else None
        method = info.methods[attr]
        resolver = info.namer.resolver if info.namer is not None else self.r
        builds = [
            c for c in calls_in(method)
            if is_optimizer_call(resolver, c)
        ]
        own = [
            c for c in calls_in(method)
            if isinstance(c.func, cst.Attribute) and c.func.attr.value in ("parameters", "named_parameters")
            and root_name(c.func.value) == "self"
        ]
        if not (builds and own):
            return None
        return method, frozenset(q for c in calls_in(method) for q in resolver.qnames(c))

    def _own_optimizer_classes(self) -> Dict[str, cst.ClassDef]:
        """Top-level classes of the script that subclass torch.optim.Optimizer."""
        return {
            node.name.value: node for node in self.module.body
            if isinstance(node, cst.ClassDef) and any(self.r.qnames(b.value) & OPTIMIZER_BASES for b in node.bases)
        }

    def _fed_models(self, names, stmt, module_names, feeders, depth: int = 3) -> List[str]:
        """Models whose parameters reach the optimizer, directly or through variables
        built earlier in the same block: `decay = [...]` from `model.named_parameters()`,
        or lists filled by a loop over them."""
        found: List[str] = []
        block = self.r.block_of(stmt)
        body = list(block.body) if block is not None else []
        earlier = body[: body.index(stmt)] if stmt in body else []
        for name in names:
            if name in module_names:
                found.append(name)
                continue
            if depth == 0:
                continue
            for source, reads in _sources_of(name, earlier):
                inner = self._fed_models(_ordered_names([cst.Arg(reads)]), source, module_names, feeders, depth - 1)
                if inner:
                    if source not in feeders:
                        feeders.append(source)
                    found.extend(n for n in inner if n not in found)
        feeders.sort(key=lambda s: body.index(s) if s in body else -1)
        return found

    def _held_by_instance(self, opt: OptimizerSite, fn, names) -> None:
        """`self.optimizer = AdamW(self.model.parameters())` in a method of a trainer class (a Solver's
        __init__): `self.optimizer` in each of its other methods, training `self.model` there."""
        model = names[fn][opt.name]
        models = dict(self._in_each_method(fn, model)) if model else {}
        for method, name in self._in_each_method(fn, opt.name):
            if method is not fn:
                names.setdefault(method, {}).setdefault(name, models.get(method, model))

    def _optimizer_names(self, optimizers, model_names):
        """Optimizer names per function, following calls; each mapped to its model's name there."""
        names: Dict[Optional[cst.FunctionDef], Dict[str, Optional[str]]] = {}
        self.lost_optimizers: Lost = {}
        for opt in optimizers:
            if opt.models:
                fn = self.r.enclosing_function(opt.stmt)
                names.setdefault(fn, {})[opt.name] = opt.models[0] if len(opt.models) == 1 else None
                if opt.inner is not None:  # `optimizer._optimizer`: the torch optimizer a wrapper holds
                    names[fn][f"{opt.name}.{opt.inner}"] = names[fn][opt.name]
                self._held_by_instance(opt, fn, names)
        changed = True
        while changed:
            changed = False
            for call, callee in self._local_calls():
                known = names.get(self.r.enclosing_function(call), {})
                bound = list(bind_args(callee, call))
                for param, arg in bound:
                    if not (isinstance(arg, cst.Name) and arg.value in known) or param in names.get(callee, {}):
                        continue
                    caller = self.r.enclosing_function(call)
                    names.setdefault(callee, {})[param] = model_in_callee(self.r, known[arg.value], bound, caller, callee)
                    for dotted in [k for k in known if k.startswith(arg.value + ".")]:
                        names[callee][param + dotted[len(arg.value):]] = names[callee][param]
                    changed = True
            changed |= self._returned_optimizers(names, model_names)
            changed |= closure_propagate(self.r, names)  # a nested function reading the optimizer around it
            changed |= global_optimizers(self.r, self.module, names)
            changed |= held_optimizers(self.r, self._holders(), names, self.lost_optimizers)
        disagreeing_calls(self.r, self.calls_of, names, self.lost_optimizers)
        return names

    def _returned_optimizers(self, names, model_names) -> bool:
        """`model, optimizer = build(cfg)`: the optimizer a helper returns is its caller's,
        mapped to the caller's name for the model it trains (None when that is not returned)."""
        changed = False
        for call, callee in self._local_calls():
            inside = names.get(callee)
            if not inside:
                continue
            caller = names.setdefault(self.r.enclosing_function(call), {})
            models_out = {there: here for here, there in
                          names_out(self.r, call, callee, model_names.get(callee, set())).items()}
            for here, there in names_out(self.r, call, callee, inside).items():
                if here not in caller:
                    caller[here] = models_out.get(inside[there])
                    changed = True
        return changed

    def _class_optimizers(self, calls) -> List[tuple]:
        out = []
        for call in calls:
            cls = self.r.enclosing_class(call)
            if cls is None or self.classes.is_module_class(cls.name.value):
                continue
            if is_optimizer_call(self.r, call):
                out.append((cls.name.value, call))
        return out


def optimizer_sites(module: cst.Module, resolver: Resolver, bindings) -> List[OptimizerSite]:
    """The optimizers that train a model of `bindings` (models.module_bindings)."""
    optimizers = OptimizerAnalysis(module, resolver)._optimizers(resolver.nodes(cst.SimpleStatementLine), bindings)
    return [o for o in optimizers if o.models]


# tensor methods and functions that need a whole matrix (or all of a tensor's elements in order)
WHOLE_TENSOR_CALLS = frozenset({
    "reshape", "view", "view_as", "flatten", "t", "transpose", "permute", "mm", "matmul", "bmm", "svd", "qr",
    "inverse", "pinv", "eigh", "cat", "stack", "outer", "einsum",
})


def whole_tensor_operation(cls: cst.ClassDef) -> Optional[cst.CSTNode]:
    """The first operation of an optimizer class's methods that works on whole matrices
    or flattens tensors (`@`, `.T`, `.reshape(...)`, `torch.linalg...`, ...): on a
    DTensor shard it either gathers the whole tensor or computes on a piece of it."""
    found: List[cst.CSTNode] = []

    class _W(cst.CSTVisitor):
        def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
            if isinstance(node.operator, cst.MatrixMultiply):
                found.append(node)

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if node.attr.value in ("T", "mT", "H", "mH", "linalg"):
                found.append(node)

        def visit_Call(self, node: cst.Call) -> None:
            func = node.func
            name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
            if name in WHOLE_TENSOR_CALLS:
                found.append(node)

    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value != "__init__":
            stmt.visit(_W())
    return found[0] if found else None


def _ordered_names(args) -> List[str]:
    """The names the arguments read, in order; `self.net` read as an attribute of a name is listed
    as itself too (a model a trainer class builds into `self.net`), before its parts."""
    seen: List[str] = []
    for a in args:
        for n in walk(a.value):
            held = instance_attribute(n)
            if held is not None and held not in seen:
                seen.append(held)
            if type(n) is cst.Name and n.value not in seen:
                seen.append(n.value)
    return seen


def _sources_of(name: str, earlier: list):
    """(statement, expression it reads) for how `name` got its value: its last
    assignment, and loops after it that append to it."""
    out = []
    for i in range(len(earlier) - 1, -1, -1):
        stmt = earlier[i]
        if isinstance(stmt, cst.SimpleStatementLine) and name in assigned_names(stmt):
            value = stmt.body[0].value if isinstance(stmt.body[0], cst.Assign) else None
            if value is not None:
                out.append((stmt, value))
            for later in earlier[i + 1 :]:
                if isinstance(later, cst.For) and _mutates(later.body, name):
                    out.append((later, later.iter))
            break
    return out


def _mutates(node, name: str) -> bool:
    found = []

    class _M(cst.CSTVisitor):
        def visit_Call(self, n: cst.Call) -> None:
            f = n.func
            if isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and f.value.value == name:
                if f.attr.value in ("append", "extend", "add", "update"):
                    found.append(n)

    node.visit(_M())
    return bool(found)
