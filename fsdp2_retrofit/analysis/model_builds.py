"""Which module class a script's build of a model makes.

`model = Net()`, `model = build_model(cfg)` (a function of the script returning what it
builds), `net = get_network(args)` of a sibling module, `MODELS[args.arch](...)`,
`LLaMA.from_pretrained(path)`: each names the class whose blocks the shard stage wraps.
ModelAnalysis (models.py) asks one BuildClasses per script.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

import libcst as cst

from .closures import nested_functions
from .flow import innermost_call
from .library_models import is_library_builder, namespace_base, namespace_builder
from .shard_anchors import _is_placement_chain
from fsdp2_retrofit.syntax.names import root_name
from fsdp2_retrofit.syntax.torch_api import NOT_MODULE_LIBRARIES, TORCH_COMPILE


STDLIB = set(getattr(sys, "stdlib_module_names", ())) | {"argparse", "logging", "collections", "dataclasses"}


class BuildClasses:
    """The module classes a script's calls build, read on one analysis (site_analysis.SiteAnalysis):
    its resolver, class registry, functions and named assignments."""

    def __init__(self, site) -> None:
        self.site = site
        self.module = site.module
        self.r = site.r
        self.classes = site.classes

    def bindings(self, stmts):
        """(name, stmt, class) for every `name = SomeModule(...)[.to(...)]` outside classes,
        also when a function of the script builds and returns it (`model = build_model()`)."""
        calls = []
        for name, stmt, value in self.site._named_assignments(stmts, methods=True):
            if self.r.is_call_to(value, TORCH_COMPILE) and value.args:
                value = value.args[0].value  # `model = torch.compile(Net())`: the shard stage splits it
            ctor = innermost_call(value)
            if ctor is not None:
                calls.append((name, stmt, ctor))
        out = [(name, stmt, cls) for name, stmt, ctor in calls for cls in [self.class_of(ctor)] if cls]
        factories = self._factories(out)
        for name, stmt, ctor in calls:
            factory = self.site._callee(ctor)
            if factory is not None and factory in factories:
                out.append((name, stmt, factories[factory]))
            chosen = (self.table_classes(ctor) or self.sibling_factory_classes(ctor) or self._classmethod_builder(ctor)
                      or self.aliased_classes(ctor))
            if chosen:
                out.append((name, stmt, chosen[0]))
            elif factory is not None and factory not in factories and not self.class_of(ctor):
                built = self.site.handed_back(ctor)
                passed = built is not None and (self.class_of(built) or next(iter(self.aliased_classes(built)), None))
                if passed:
                    out.append((name, stmt, passed))
        return out

    def chosen_classes(self, expr: cst.BaseExpression, before: Optional[cst.CSTNode] = None) -> List[str]:
        """The module classes of the script or its sibling modules that `expr` may hold, followed by
        value (flow.py): both sides of `RNNModel(...) if lstm else BagModel(...)`, every return of a
        function of the script building one of several (`def build(args): if ...: return A(...)` /
        `return B(...)`), a name bound in each branch of an if/else, a table's entries; in source
        order. [] unless every origin builds such a class (a library model, a value not seen into).
        The one question `rewrite` (ModelAnalysis._alternatives) and `check` (FSD122) ask of a model
        whose class is chosen at run time. `before`: a statement of the function that reads the value
        (`fully_shard(model)`); builds after it in that function are not what it reads (the flow is
        flow-insensitive: `model = A(); fully_shard(model); model = B()`)."""
        out: List[str] = []
        origins = sorted(self.site.flow.values(expr), key=lambda o: self.r.order(o) if isinstance(o, cst.CSTNode) else -1)
        if before is not None:
            scope = self.r.enclosing_function(before)
            origins = [o for o in origins if not isinstance(o, cst.CSTNode) or self.r.enclosing_function(o) is not scope
                       or self.r.order(o) < self.r.order(before)]
        for origin in origins:
            call = innermost_call(origin) if isinstance(origin, cst.CSTNode) else None
            if call is None:
                return []
            found = self.table_classes(call) or self.aliased_classes(call)
            if not found:
                cls = self.class_of(call)
                found = [cls] if cls and not is_library_builder(cls) and self.classes.is_module_class(cls) else []
            if not found:
                return []
            out += [c for c in found if c not in out]
        return out

    def aliased_classes(self, call: cst.Call) -> List[str]:
        """`net(z_dim)` where `net` holds one of the script's module classes, chosen before (`if kind == "H":
        net = BetaVAE_H` / `elif ...: net = BetaVAE_B`), followed by value: those classes; [] unless every
        value the name can hold is one."""
        if type(call.func) is not cst.Name or self.class_of(call):
            return []  # a class called by its own name: class_of's
        out: List[str] = []
        for value in self.site.flow.values(call.func):
            name = value.name.value if type(value) is cst.ClassDef and self.r.enclosing_class(value) is None else None
            if name is None or not self.classes.is_module_class(name):
                return []
            out += [name] if name not in out else []
        return out

    def _classmethod_builder(self, call: cst.Call) -> List[str]:
        """`model = LLaMA.from_pretrained(path)`: a classmethod (or staticmethod) of a module class
        of the script or a sibling module whose every return gives back an instance it builds of
        that class (`cls(...)`, `LLaMA(...)`, or a name of the method bound once to one): [that
        class]; [] otherwise. The instance is complete when the call returns, as after a constructor."""
        func = call.func
        if type(func) is not cst.Attribute:
            return []
        cls = next((q for q in sorted(self.r.qnames(func.value)) if self.classes.is_module_class(q)), None)
        info = self.classes.get(cls)
        method = info.methods.get(func.attr.value) if info is not None else None
        if method is None or not any(type(d.decorator) is cst.Name and d.decorator.value in ("classmethod", "staticmethod")
                                     for d in method.decorators):
            return []
        namer = info.namer
        bare = info.node.name.value
        bound = {}
        for stmt in method.body.body:
            small = stmt.body[0] if type(stmt) is cst.SimpleStatementLine and len(stmt.body) == 1 else None
            if type(small) is cst.Assign and len(small.targets) == 1 and type(small.targets[0].target) is cst.Name:
                name = small.targets[0].target.value
                bound[name] = None if name in bound else small.value  # bound twice: not one value
        returns = [r for r in (namer.resolver.descendants(method, cst.Return) if namer is not None else [])
                   if namer.resolver.enclosing_function(r) is method]
        for ret in returns:
            value = ret.value
            if type(value) is cst.Name:
                value = bound.get(value.value)
            built = innermost_call(value) if value is not None else None
            if built is None or type(built.func) is not cst.Name or built.func.value not in ("cls", bare):
                return []
        return [cls] if returns else []

    def sibling_factory_classes(self, call: cst.Call) -> List[str]:
        """`net = get_network(args)` of a function of a sibling module (`from utils import
        get_network`) whose every return builds one module class: that class; [] otherwise."""
        for qname in sorted(self.r.qnames(call)):
            namespace, _, name = qname.rpartition(".")
            found = self.classes.top_level.get(namespace) if namespace else None
            if found is None or name not in self.classes.top_level_functions.get(namespace, {}):
                continue
            built = self.classes.classes_built_by(cst.Name(name), found[1])
            if len(built) == 1:
                return built
        return []

    def table_classes(self, call: cst.Call) -> List[str]:
        """`MODELS[args.arch](...)`: the module classes of the one top-level dict literal
        `MODELS` (of the script or a sibling module) whose values are classes or functions
        building one; [] unless every value is read. `models.__dict__[args.arch]()` or
        `getattr(models, args.arch)()` of a package of the project: the module classes
        its namespace offers (ClassRegistry.namespace_classes)."""
        func = call.func
        base = namespace_base(self.r, call)
        if base is not None:
            return next((found for q in sorted(self.r.qnames(base))
                         for found in [self.classes.namespace_classes(q)] if found), [])
        if not isinstance(func, cst.Subscript):
            return []
        found = None
        for qname in sorted(self.r.qnames(func.value)):
            found = self.classes.top_level_value(qname)
            if found is not None:
                break
        if found is None or not isinstance(found[0], cst.Dict) or not found[0].elements:
            return []
        out: List[str] = []
        for element in found[0].elements:
            built = self.classes.classes_built_by(element.value, found[1]) if isinstance(
                element, cst.DictElement) else []
            if not built:
                return []
            out += [c for c in built if c not in out]
        return out

    def _factories(self, bindings) -> Dict[cst.FunctionDef, str]:
        """Functions of the script (top-level, or nested in another function) that return
        a module they build -> its class."""
        out: Dict[cst.FunctionDef, str] = {}
        locals_of: Dict[Optional[cst.FunctionDef], Dict[str, str]] = {}
        for b in bindings:
            locals_of.setdefault(self.r.enclosing_function(b[1]), {})[b[0]] = b[2]
        returns_of: Dict[Optional[cst.FunctionDef], List[cst.Return]] = {}
        for r in self.r.nodes(cst.Return):
            returns_of.setdefault(self.r.enclosing_function(r), []).append(r)
        top = [fn for fn in self.module.body if isinstance(fn, cst.FunctionDef)]
        for fn in top + [inner for inner, _ in nested_functions(self.r)]:
            local = locals_of.get(fn, {})
            for ret in returns_of.get(fn, []):
                value = ret.value
                while _is_placement_chain(value, root_name(value) or "") and isinstance(value, cst.Call):
                    value = value.func.value  # `return model.to(device)`
                if isinstance(value, cst.Name) and value.value in local:
                    out[fn] = local[value.value]
                elif value is not None and innermost_call(value) is not None:
                    cls = self.class_of(innermost_call(value))
                    if cls:
                        out[fn] = cls
        return out

    def class_of(self, call: cst.Call) -> Optional[str]:
        """The module class `call` builds: the script's or a sibling module's, a library builder, or a
        capitalised name imported from a library that is not torch's (the optimizer decides); else None."""
        chosen = namespace_builder(self.r, call)  # `models.__dict__[args.arch](...)`
        if chosen is not None:
            return chosen
        for name in sorted(self.r.qnames(call)):
            if is_library_builder(name):
                return name  # `AutoModelForCausalLM.from_pretrained(...)`, `torchvision.models.resnet50(...)`
            if self.classes.is_module_class(name):
                return name
            # a class imported from a library, e.g. torchvision.models.resnet18: only
            # known when something trains it; the optimizer decides.
            if (
                "." in name
                and name.rsplit(".", 1)[-1][:1].isupper()
                and not name.startswith("torch.")
                and not name.startswith(NOT_MODULE_LIBRARIES)
                and name.split(".")[0] not in STDLIB
            ):
                return name
        return None


def handed_build(value: cst.BaseExpression, facts) -> Optional[str]:
    """"construction" for `Net(...)`, `Net(...).to(device)`, `resnet18()` written as a call's argument
    (a module class of the project or a library model); "factory" for `build_net(cfg)`, a call of a
    function of the script or a sibling module whose every return builds one (followed by value:
    BuildClasses); None otherwise (an if/else of two builds included)."""
    ctor = innermost_call(value)
    if ctor is None or type(value) is cst.IfExp:
        return None
    r, classes = facts.resolver, facts.classes
    if any(classes.is_module_class(q) or is_library_builder(q) for q in r.qnames(ctor)):
        return "construction"
    if not project_callee(ctor, r, classes):
        return None  # a library call (torch.randn(...)), a method, a name bound otherwise
    builds = BuildClasses(facts.analysis)
    return "factory" if builds.chosen_classes(value) or builds.sibling_factory_classes(ctor) else None


def project_callee(call: cst.Call, resolver, classes) -> bool:
    """A call of a class (not a module class) or a top-level function of the script or of a
    sibling module: a trainer, a solver, a helper the script hands things to."""
    for qname in resolver.qnames(call.func):
        if classes.get(qname) is not None and not classes.is_module_class(qname):
            return True
        namespace, _, name = qname.rpartition(".")
        if name in classes.top_level_functions.get(namespace, {}):
            return True
    return False


def handed_builds(facts):
    """(call, argument) for each model build written as an argument of a call of the project
    (project_callee)."""
    r = facts.resolver
    for call in r.nodes(cst.Call):
        if not project_callee(call, r, facts.classes):
            continue
        for arg in call.args:
            if not arg.star and handed_build(arg.value, facts):
                yield call, arg
