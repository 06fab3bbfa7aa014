"""Models: the names bound to nn.Module instances (built here, by a factory function
or a library), which an optimizer trains, copies and frozen models, where each is
sharded, and the forward calls and trainer classes that use them."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Set

import libcst as cst

from .closures import closure_propagate, nested_functions
from .held_values import held_models
from .init_branches import branch_initialises, initialised_name, initialised_names
from .library_models import PEFT_WRAPPERS, LibraryModel, is_library_builder, library_model, namespace_base, \
    namespace_builder
from .model_classes import ClassRegistry, Container, build_registry
from .flow import innermost_call
from .returns import names_out
from .site_analysis import Block, Scope, SiteAnalysis
from fsdp2_retrofit.syntax.names import (
    PLACEMENT_METHODS,
    SELF_RETURNING_METHODS,
    Resolver,
    alias_target,
    assigned_names,
    bind_args,
    calls_in,
    code,
    instance_attribute,
    is_main_guard,
    module_itself,
    names_in,
    parameter_names,
    root_name,
    walk,
)
from fsdp2_retrofit.syntax.torch_api import AVERAGED_MODEL, FULLY_SHARD, NOT_MODULE_LIBRARIES, TORCH_COMPILE, TORCH_LOAD


STDLIB = set(getattr(sys, "stdlib_module_names", ())) | {"argparse", "logging", "collections", "dataclasses"}


@dataclass
class ModelSite:
    """A name bound to an nn.Module instance that an optimizer trains."""

    name: str
    stmt: cst.SimpleStatementLine
    block: Block
    scope: Scope
    class_name: Optional[str]
    top: cst.CSTNode  # the statement of the entry block that builds it (stmt, or an if/else around it)
    shard_anchor: cst.CSTNode  # fully_shard goes right after this statement
    containers: List[Container] = field(default_factory=list)
    tied_containers: List[Container] = field(default_factory=list)
    sharded: bool = False
    library: Optional[LibraryModel] = None  # built by transformers/torchvision/timm (see library_models)
    copy_of: Optional[str] = None  # `ema = copy.deepcopy(model)`: the model it copies
    copy_call: Optional[cst.Call] = None  # and that copy.deepcopy call
    # `model = Wrapper(model)` before the model is used: fully_shard cannot follow the name
    rebound_by: Optional[cst.CSTNode] = None
    # `name.apply(init)` after the shard anchor, before the model is used, inside an
    # if/else (`if resume: load else: init`): it runs on the sharded module
    late_init: Optional[cst.Call] = None
    # the classes the name may hold when the script chooses one at run time (`MODELS[args.arch](...)`,
    # an if/elif building different classes into it); empty when it is one class
    alternatives: List[str] = field(default_factory=list)
    # the blocks cannot be read statically (the alternatives' repeated blocks differ, or a
    # table's entries decide): the shard stage finds them when the script runs
    runtime_blocks: bool = False
    # the names that hold this model, per function: its own, aliases (`m = model.to(device)`),
    # parameters handed it, names a helper returns it to, closures and globals reading it
    names: Dict[Optional[cst.FunctionDef], Set[str]] = field(default_factory=dict)


class ModelAnalysis(SiteAnalysis):
    """Finds the models, their copies and their shard anchors."""

    def _module_bindings(self, stmts):
        """(name, stmt, class) for every `name = SomeModule(...)[.to(...)]` outside classes,
        also when a function of the script builds and returns it (`model = build_model()`)."""
        calls = []
        for name, stmt, value in self._named_assignments(stmts, methods=True):
            if self.r.is_call_to(value, TORCH_COMPILE) and value.args:
                value = value.args[0].value  # `model = torch.compile(Net())`: the shard stage splits it
            ctor = innermost_call(value)
            if ctor is not None:
                calls.append((name, stmt, ctor))
        out = [(name, stmt, cls) for name, stmt, ctor in calls for cls in [self._class_of(ctor)] if cls]
        factories = self._factories(out)
        for name, stmt, ctor in calls:
            factory = self._callee(ctor)
            if factory is not None and factory in factories:
                out.append((name, stmt, factories[factory]))
            chosen = self._table_classes(ctor) or self._sibling_factory_classes(ctor) or self._classmethod_builder(ctor)
            if chosen:
                out.append((name, stmt, chosen[0]))
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

    def _sibling_factory_classes(self, call: cst.Call) -> List[str]:
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

    def _table_classes(self, call: cst.Call) -> List[str]:
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

    def _alternatives(self, name: str, stmt, top) -> tuple:
        """(the classes `name` may hold, whether its blocks are decided at run time): a
        table's entries, or the classes the branches of the if/elif around it build."""
        value = getattr(stmt.body[0], "value", None)
        ctor = innermost_call(value) if value is not None else None
        chosen = self._table_classes(ctor) if ctor is not None else []
        if chosen:
            return chosen, True
        if top is stmt:
            return [], False
        span = self.r.span(top)
        classes: List[str] = []
        for other, other_stmt, cls in getattr(self, "_bindings", ()):
            if other == name and span[0] <= self.r.order(other_stmt) <= span[1] and cls not in classes:
                classes.append(cls)
        if len(classes) < 2 or any(is_library_builder(c) for c in classes):
            return [], False
        layouts = {
            tuple(sorted((c.path, c.block_class) for c in self.classes.block_containers(cls) if c.block_class))
            for cls in classes
        }
        return classes, len(layouts) > 1

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
                    cls = self._class_of(innermost_call(value))
                    if cls:
                        out[fn] = cls
        return out

    def _class_of(self, call: cst.Call) -> Optional[str]:
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

    def _trained_models(self, optimizers, bindings) -> List["ModelSite"]:
        """The first binding, in the optimizer's own function, of each name it trains."""
        self._bindings = bindings  # read by _alternatives
        # classes (not modules) whose methods build an optimizer (a trainer's run()): fully_shard
        # goes before any construction of them (_shard_anchor)
        self._building_classes = {
            cls.name.value for opt in optimizers for fn in [self.r.enclosing_function(opt.stmt)] if fn is not None
            for cls in [self.r.enclosing_class(fn)] if cls is not None
        }
        self._optimizer_stmts = {id(opt.stmt) for opt in optimizers}  # _shard_anchor stops before a branch building one
        models: List[ModelSite] = []
        seen = set()
        for opt in optimizers:
            scope = self.r.enclosing_function(opt.stmt)
            for name in opt.models:
                if (scope, name) in seen:
                    continue
                binding = next(
                    (b for b in bindings if b[0] == name and self.r.enclosing_function(b[1]) is scope), None
                )
                if binding is None:
                    binding = self._binding_by_value(opt, name, bindings)
                key = (self.r.enclosing_function(binding[1]), binding[0]) if binding is not None else None
                if binding is not None and key not in seen:
                    seen.add((scope, name))
                    seen.add(key)
                    models.append(self._model_site(binding))
        order = {id(s): i for i, s in enumerate(self.r.nodes(cst.SimpleStatementLine))}
        models.sort(key=lambda m: order.get(id(m.stmt), 0))
        return models

    def _binding_by_value(self, opt, name: str, bindings) -> Optional[tuple]:
        """The binding of the module the optimizer's `name` holds when it is not bound in the
        optimizer's function (see SiteAnalysis._module_binding_of)."""
        attrs = {id(a.attr) for a in walk(opt.stmt) if type(a) is cst.Attribute}
        read = next((n for n in walk(opt.stmt) if type(n) is cst.Name and n.value == name and id(n) not in attrs), None)
        if read is None:  # `self.model.parameters()` in a trainer's method: the attribute, followed by value
            read = next((a for a in walk(opt.stmt) if instance_attribute(a) == name), None)
        return self._module_binding_of(read, bindings) if read is not None else None

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

    def _model_site(self, binding, frozen: bool = False) -> ModelSite:
        name, stmt, cls = binding
        top, block = self._scope_body(stmt)
        scope = self.r.enclosing_function(stmt) or self.module
        library = self._library_model(stmt, cls)
        if library is not None:
            containers = [Container(path, block, "library", stmt) for path, block in library.containers]
        else:
            containers = [c for c in self.classes.block_containers(cls) if c.block_class]
        ties = self.classes.ties(cls)
        tied = [c for c in containers if any(_under(a, c.path) or _under(b, c.path) for a, b in ties)]
        anchor = self._shard_anchor(name, top, block, frozen)
        alternatives, runtime = self._alternatives(name, stmt, top) if library is None else ([], False)
        if runtime:
            containers, tied = [], []
        return ModelSite(
            name=name,
            stmt=stmt,
            block=block,
            scope=scope,
            class_name=cls,
            top=top,
            shard_anchor=anchor,
            rebound_by=None if frozen else self._rebound_by(name, top, block),
            late_init=None if frozen else _late_init(name, anchor, block),
            containers=[c for c in containers if c not in tied],
            tied_containers=tied,
            library=library,
            alternatives=alternatives,
            runtime_blocks=runtime,
        )

    def _library_model(self, stmt, cls: Optional[str]) -> Optional[LibraryModel]:
        """The layout of a model a library builds; the call is read when this statement
        makes it (a factory function's model is known by the builder's name only)."""
        if not cls or not is_library_builder(cls):
            return None
        value = stmt.body[0].value
        if self.r.is_call_to(value, TORCH_COMPILE) and value.args:
            value = value.args[0].value
        call = innermost_call(value)
        found = library_model(cls, call if call is not None and cls in self.r.qnames(call) else None, self.r)
        name = stmt.body[0].targets[0].target.value
        for save in self.calls:  # `model.push_to_hub(...)`, in any function that names it `model`
            func = save.func
            if (isinstance(func, cst.Attribute) and func.attr.value == "push_to_hub"
                    and isinstance(func.value, cst.Name) and func.value.value == name):
                return replace(found, refusal_at=save, refusal=(
                    "FSR615",
                    f"`{code(func)}` of a model the rewrite shards",
                    "after fully_shard each rank holds only its shards: the library would upload one rank's "
                    "pieces (or fail on DTensors), and push_to_hub takes no gathered state dict",
                    f"save with {name}.save_pretrained(dir) (the rewrite gathers the full state for it) and "
                    "upload that folder on rank 0",
                ))
        for later in self.r.nodes(cst.Assign):  # `model = get_peft_model(model, config)`
            if (
                self.r.calls_prefix(later.value, PEFT_WRAPPERS) and name in assigned_names(self.r.parent(later))
                and self.r.enclosing_function(later) is self.r.enclosing_function(stmt)
            ):
                return replace(found, refusal_at=later, refusal=(
                    "FSR616",
                    f"`{name}` is wrapped by `{code(later.value.func)}` (PEFT) after it is built",
                    "the adapters are added after the rewrite shards the model: their parameters would stay "
                    "plain tensors whose gradients no rank reduces, and the ranks would drift apart",
                    "train without PEFT, or keep the script single-GPU (PEFT with FSDP2 is not supported yet)",
                ))
        return found

    def _frozen_models(self, bindings, models, copies) -> List[ModelSite]:
        """Modules no optimizer trains that the script freezes: `requires_grad_(False)`,
        a loop setting `p.requires_grad = False` over its parameters, or `eval()`
        (in its build expression or a statement of its function). Loss modules aside."""
        seen = {(m.scope, m.name) for m in models + copies}
        out: List[ModelSite] = []
        for binding in bindings:
            name, stmt, cls = binding
            scope = self.r.enclosing_function(stmt) or self.module
            if (scope, name) in seen or cls.rsplit(".", 1)[-1].endswith("Loss"):
                continue
            seen.add((scope, name))  # the first binding of the name decides
            if self._is_frozen(name, stmt) and not self._part_of_trained(name, scope, models):
                out.append(self._model_site(binding, frozen=True))
        return out

    def _part_of_trained(self, name: str, scope, models) -> bool:
        """A frozen module handed to a trained model's constructor, or stored on it
        (`model.encoder = encoder`): it is part of that model and sharded with it."""
        for m in models:
            if m.scope is scope and name in names_in(m.stmt.body[0].value):
                return True
        for assign in self.r.nodes(cst.Assign):
            if (self.r.enclosing_function(assign) or self.module) is not scope or name not in names_in(assign.value):
                continue
            for t in assign.targets:
                if isinstance(t.target, cst.Attribute) and root_name(t.target) in {m.name for m in models}:
                    return True
        return False

    def _is_frozen(self, name: str, stmt) -> bool:
        function = self.r.enclosing_function(stmt)
        value = stmt.body[0].value
        while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
            if _freeze_call(value, None):
                return True  # `Teacher().to(device).eval()`
            value = value.func.value
        for call in self.calls:
            if _freeze_call(call, name) and self.r.enclosing_function(call) is function:
                return True
        return any(
            _freezing_loop(loop, name) and self.r.enclosing_function(loop) is function
            for loop in self.r.nodes(cst.For)
        )

    def _copies(self, models: List[ModelSite], stmts) -> List[ModelSite]:
        """`ema = copy.deepcopy(model)` (or `AveragedModel(model, ...)`, whose `.module` is
        the copy) statements the rewrite can shard like the model: in the block that
        builds it, after the build, with no statement between that rebinds or shards the
        model or runs a loop or block using it. The model's fully_shard moves after the
        copy (and what prepares the copy)."""
        out: List[ModelSite] = []
        for stmt in stmts:
            if len(stmt.body) != 1 or type(stmt.body[0]) is not cst.Assign:
                continue
            assign = stmt.body[0]
            call = innermost_call(assign.value)  # also `copy.deepcopy(model).eval()`
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name) or call is None:
                continue
            # AveragedModel(model, ...) deep-copies the model into its `.module`: that is what gets sharded
            averaged = self.r.is_call_to(call, AVERAGED_MODEL)
            copied = call.args[0].value if call.args and call.args[0].keyword is None and not call.args[0].star else None
            if not ((averaged or (self.r.is_call_to(call, {"copy.deepcopy"}) and len(call.args) == 1))
                    and isinstance(copied, cst.Name)):
                continue
            scope = self.r.enclosing_function(stmt) or self.module
            source = next((m for m in models if m.name == copied.value and m.scope is scope), None)
            body = list(source.block.body) if source is not None else []
            if source is None or stmt not in body or source.top not in body:
                continue
            between = body[body.index(source.top) + 1 : body.index(stmt)]
            if body.index(stmt) < body.index(source.top) or any(
                (not isinstance(s, cst.SimpleStatementLine) and not _is_placement(s, source.name)
                 and source.name in names_in(s))
                or source.name in assigned_names(s)
                or any(self.r.qnames(c) & FULLY_SHARD for c in calls_in(s))
                for s in between
            ):
                continue
            name = assign.targets[0].target.value
            site = ModelSite(
                name=name + ".module" if averaged else name,
                stmt=stmt,
                block=source.block,
                scope=scope,
                class_name=source.class_name,
                top=stmt,
                shard_anchor=self._shard_anchor(name, stmt, source.block, frozen=True),
                containers=list(source.containers),
                tied_containers=list(source.tied_containers),
                alternatives=list(source.alternatives),
                runtime_blocks=source.runtime_blocks,
                copy_of=source.name,
                copy_call=call,
            )
            # the model is sharded after its copy: both after the later of their anchors
            if body.index(site.shard_anchor) > body.index(source.shard_anchor):
                source.shard_anchor = site.shard_anchor
            out.append(site)
        for site in out:
            source = next(m for m in models if m.name == site.copy_of and m.scope is site.scope)
            site.shard_anchor = source.shard_anchor
        return out

    def _hidden_copies(self, calls, trained_names) -> List[tuple]:
        """Copies of a trained model made inside a constructor: AveragedModel(model, ...),
        or a class of the script whose methods call copy.deepcopy (an EMA helper)."""
        copying = {
            c.name.value
            for c in self.module.body
            if isinstance(c, cst.ClassDef)
            and any(self.r.is_call_to(call, {"copy.deepcopy"}) for call in self.r.descendants(c, cst.Call))
        }
        out = []
        for call in calls:
            if not (call.args and type(call.args[0].value) is cst.Name):
                continue
            if call.args[0].value.value not in trained_names.get(self.r.enclosing_function(call), set()):
                continue
            if self.r.is_call_to(call, AVERAGED_MODEL):
                out.append(("AveragedModel", call))
            elif isinstance(call.func, cst.Name) and call.func.value in copying:
                out.append((call.func.value, call))
        return out

    def _shard_anchor(self, name: str, stmt, block, frozen: bool = False) -> cst.CSTNode:
        """The last statement that builds or places the model before it is used; for a
        frozen model or a copy, also what freezes or restructures it (eval(),
        requires_grad_(False), a loop over its parameters, a new submodule), up to the
        first other statement that uses it."""
        body = list(block.body)
        anchor = stmt
        used = False  # by an optimizer or a forward: later restructuring stays after fully_shard
        for later in body[body.index(stmt) + 1 :]:
            if isinstance(later, (cst.FunctionDef, cst.ClassDef)) and name not in names_in(later):
                continue  # a definition that never mentions the model (an init function): it runs nothing here
            if frozen and (_prepares(later, name) or (restructures(later, name) and not self._loads_checkpoint(later))):
                anchor = later  # frozen, then given a new head (`name.fc = nn.Linear(...)`): shard the final module
                continue
            if frozen and name in names_in(later):
                break  # a load_state_dict, a forward: after sharding, as for a trained model
            if not frozen and not used and restructures(later, name) and not self._loads_checkpoint(later):
                anchor = later  # a new head, a frozen part, loaded weights: fully_shard sees the final module
                continue
            used = used or _consumes(later, name)
            if not frozen and any(type(c.func) is cst.Name and c.func.value in getattr(self, "_building_classes", ())
                                  for c in calls_in(later)):
                break  # `Trainer(model, ...)`, whose methods build the optimizer: the model is sharded before it
            if not frozen and type(later) is not cst.SimpleStatementLine and any(
                    id(s) in getattr(self, "_optimizer_stmts", ()) for s in self.r.descendants(later, cst.SimpleStatementLine)):
                break  # `if adam: opt = Adam(model.parameters()) else: ...`: no stage moves a branch, shard before it
            if isinstance(later, (cst.For, cst.While, cst.FunctionDef, cst.With, cst.Try)):
                break
            if _is_placement(later, name) or _initialises(later, name) or self._initialises_through(later, name):
                anchor = later
            elif name in assigned_names(later):
                break  # rebound by something else (torch.compile, a wrapper): shard before it
        return anchor

    def _initialises_through(self, stmt, name: str, depth: int = 2) -> bool:
        """`init_head(model)`: a call of a function of the script handed the model, whose
        body initialises in place (an nn.init call anywhere in it, on the model's
        parameters or through a loop over its modules; `.apply(fn)`; or a call of another
        such function): done before sharding like the same calls written inline (after it,
        each rank would draw its own shard's values)."""
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1 or type(stmt.body[0]) is not cst.Expr:
            return False
        call = stmt.body[0].value
        if type(call) is not cst.Call:
            return False
        function = self._callee(call)
        if function is None:
            return False
        for param, arg in bind_args(function, call):
            if type(arg) is not cst.Name or arg.value != name:
                continue
            if any(initialised_name(c) is not None for c in self.r.descendants(function.body, cst.Call)):
                return True
            if depth and any(self._initialises_through(inner, param, depth - 1)
                             for inner in self.r.descendants(function.body, cst.SimpleStatementLine)):
                return True
        return False

    def _loads_checkpoint(self, stmt) -> bool:
        """`model.load_state_dict(torch.load(p))` (or of a name bound to torch.load's
        value): the resume stage loads it into the sharded model, after fully_shard."""
        loaded = set()
        function = self.r.enclosing_function(stmt)
        for call in calls_in(stmt):
            if isinstance(call.func, cst.Attribute) and call.func.attr.value == "load_state_dict":
                if any(self.r.is_call_to(c, TORCH_LOAD) for a in call.args for c in calls_in(a.value)):
                    return True
                loaded |= {n for a in call.args for n in names_in(a.value)}
        for node in self.r.nodes(cst.SimpleStatementLine):
            if (assigned_names(node) & loaded and self.r.enclosing_function(node) is function
                    and any(self.r.is_call_to(c, TORCH_LOAD) for c in calls_in(node))):
                return True
        return False

    def _rebound_by(self, name: str, stmt, block) -> Optional[cst.CSTNode]:
        """The statement `name = Wrapper(name, ...)` that rebinds the model to an object
        wrapping it, where _shard_anchor stops (torch.compile, placement and PEFT, which has
        its own refusal, excepted)."""
        body = list(block.body)
        for later in body[body.index(stmt) + 1 :]:
            if isinstance(later, (cst.For, cst.While, cst.FunctionDef, cst.With, cst.Try)) and not restructures(later, name):
                return None
            if name not in assigned_names(later) or _is_placement(later, name):
                continue
            small = later.body[0]
            call = innermost_call(small.value) if isinstance(small, cst.Assign) else None
            if (call is None or self.r.is_call_to(call, TORCH_COMPILE) or self.r.calls_prefix(small.value, PEFT_WRAPPERS)
                    or not any(isinstance(a.value, cst.Name) and a.value.value == name for a in call.args)):
                return None
            return later
        return None

    def _model_names(self, models: List[ModelSite]) -> Dict[Optional[cst.FunctionDef], Set[str]]:
        """Model names per function, following calls that pass a model as an argument and
        nested functions that read one of the function around them (a closure)."""
        names: Dict[Optional[cst.FunctionDef], Set[str]] = {}
        for m in models:
            held = self._in_each_method(self.r.enclosing_function(m.stmt), m.name)
            if held:  # `self.net = Net()` in a trainer class's method: `self.net` in each of its methods
                for method, name in held:
                    names.setdefault(method, set()).add(name)
                continue
            # `ema.module` (an AveragedModel's copy) is sharded; `ema` is the model the script uses
            names.setdefault(self.r.enclosing_function(m.stmt), set()).add(m.name.split(".", 1)[0])
        changed = True
        while changed:
            changed = False
            for call, callee in self._local_calls():
                known = names.get(self.r.enclosing_function(call), set())
                for param in _params_receiving(callee, call, known):
                    if param not in names.setdefault(callee, set()):
                        names[callee].add(param)
                        changed = True
            changed |= self._add_globals(names)
            changed |= self._add_aliases(names)
            changed |= self._add_returns(names)
            changed |= closure_propagate(self.r, names)
            changed |= held_models(self.r, self._holders(), names)
        return names

    def _add_returns(self, names) -> bool:
        """`model, optimizer = build(cfg)`: a helper that returns its model hands it to
        the names its caller assigns."""
        changed = False
        for call, callee in self._local_calls():
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
        name), in source order; found once per analysis (_model_names asks each round)."""
        found = self.__dict__.get("_plain_assignment_list")
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

    def _forward_calls(self, model_names) -> List[cst.Call]:
        out = []
        for call in self.calls:
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "forward"):
                continue
            target = func.value
            # `model.forward(x)`, `self.model.forward(x)` in a trainer's method
            if (target.value if isinstance(target, cst.Name) else instance_attribute(target)) in model_names.get(
                self.r.enclosing_function(call), set()
            ):
                out.append(call)
        return out

    def _trainer_classes(self, calls, model_names, bindings) -> List[tuple]:
        """(label, call) for each `Trainer(model, ...)` of a sibling module's class that is not a
        module and whose methods call backward(), built with a model (a trained one, or a name bound
        in the caller's function by a module's construction): the label names the class, the file
        and the line of its backward() ("Trainer (trainer.py:19)"), a file this rewrite does not
        edit. A trainer class of the script itself is not listed: the stages follow the model,
        optimizer, loader and saves into its methods by value (analysis/flow.py, held_values.py)."""
        built = {}
        for name, stmt, _ in bindings:
            built.setdefault(self.r.enclosing_function(stmt), set()).add(name)
        out = []
        for call in calls:
            label = self._sibling_trainer(call)
            if label is None:
                continue
            scope = self.r.enclosing_function(call)
            known = model_names.get(scope, set()) | built.get(scope, set())
            if any(isinstance(a.value, cst.Name) and a.value.value in known for a in call.args):
                out.append((label, call))
        return out

    def _sibling_trainer(self, call: cst.Call) -> Optional[str]:
        """"Trainer (trainer.py:19)" when `call` builds a class of a sibling module that is
        not a module and calls backward() in a method; else None."""
        for qname in sorted(self.r.qnames(call.func)):
            info = self.classes.get(qname)
            if info is None or info.is_module or not info.file or info.namer is None or not info.namespace:
                continue  # not a class, a module, or the script's own class (its stages convert it)
            backward = _first_method_call(info.node, "backward")
            if backward is not None:
                line = info.namer.resolver.line(backward)
                return f"{info.node.name.value} ({self.classes.shown_file(info.namespace)}:{line})"
        return None

    def _shard_statements(self, stmts) -> Dict[str, cst.SimpleStatementLine]:
        out = {}
        for stmt in stmts:
            for small in stmt.body:
                call = small.value if type(small) is cst.Expr else None
                if call is None:
                    continue
                if (
                    type(call) is cst.Call
                    and self.r.qnames(call) & FULLY_SHARD
                    and call.args
                    and isinstance(call.args[0].value, cst.Name)
                ):
                    out[call.args[0].value.value] = stmt
                elif (  # `fully_shard(ema.module)`: an AveragedModel's copy; `fully_shard(self.model)` in a Solver
                    isinstance(call, cst.Call)
                    and self.r.qnames(call) & FULLY_SHARD
                    and call.args
                    and instance_attribute(call.args[0].value)
                ):
                    out[instance_attribute(call.args[0].value)] = stmt
        return out


def module_bindings(module: cst.Module, resolver: Resolver, classes: Optional[ClassRegistry] = None):
    """(name, statement, class) of every name bound to a module instance outside classes."""
    classes = classes if classes is not None else build_registry(module, resolver, None)
    return ModelAnalysis(module, resolver, classes)._module_bindings(resolver.nodes(cst.SimpleStatementLine))


def trained_models(module: cst.Module, resolver: Resolver, optimizers, bindings,
                   classes: Optional[ClassRegistry] = None) -> List[ModelSite]:
    """The models of `bindings` that `optimizers` (optimizers.optimizer_sites) train."""
    classes = classes if classes is not None else build_registry(module, resolver, None)
    return ModelAnalysis(module, resolver, classes)._trained_models(optimizers, bindings)


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


def _is_placement(stmt, name: str) -> bool:
    """`m.to(d)`, `m = m.cuda()`, or an `if` whose body only does such things, to `m`
    and to other names (`if cuda: G = G.cuda(); D = D.cuda(); loss_fn.cuda()`)."""
    if isinstance(stmt, cst.If):
        inner = list(stmt.body.body) if isinstance(stmt.body, cst.IndentedBlock) else [stmt.body]
        placed = [_placed_name(s) for s in inner]
        return bool(inner) and stmt.orelse is None and None not in placed and name in placed
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for small in stmt.body:
        value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
        if isinstance(small, cst.Assign):
            targets = small.targets
            if len(targets) != 1 or not (isinstance(targets[0].target, cst.Name) and targets[0].target.value == name):
                return False
        if not _is_placement_chain(value, name):
            return False
    return True


def _placed_name(stmt) -> Optional[str]:
    """The name a statement only moves or casts (`x = x.cuda()`, `x.to(d)`), or None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
    name = root_name(value) if isinstance(value, cst.Call) else None
    return name if name is not None and _is_placement(stmt, name) else None


def _initialises(stmt, name: str) -> bool:
    """`model.apply(init_fn)`, `nn.init.normal_(model.fc.weight)`, or an `if` (no else)
    of such calls on this and other models (the initialising half of a split resume-or-
    initialise, analysis/init_branches.py): an in-place (re)initialisation, done before
    sharding."""
    if isinstance(stmt, cst.If) and stmt.orelse is None:
        return name in (branch_initialises(stmt.body) or ())
    if name in (initialised_names(stmt) or ()):
        return True
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
    return (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value == "apply"
        and isinstance(value.func.value, cst.Name)
        and value.func.value.value == name
    )


FREEZE_METHODS = {"eval", "train", "requires_grad_"}


def _late_init(name: str, anchor, block) -> Optional[cst.Call]:
    """`name.apply(...)` in a compound statement of `block` after the build (`if
    resume: load ... else: name.apply(init)`), before a statement that uses the model:
    the shard anchor stops before such a statement, so the call runs on the sharded
    module. Each rank then initialises its own shards (a valid initialisation, not the
    one the single-process run draws)."""
    body = list(block.body)
    for later in body[body.index(anchor) + 1:]:
        if isinstance(later, cst.SimpleStatementLine):
            if _consumes(later, name):
                return None
            continue
        if isinstance(later, (cst.FunctionDef, cst.ClassDef)):
            continue
        for call in calls_in(later):
            func = call.func
            if (isinstance(func, cst.Attribute) and func.attr.value == "apply" and _rooted_at(func.value, name)) \
                    or initialised_name(call) == name:
                return call
        if _consumes(later, name) and not _is_placement(later, name):
            return None
    return None


def _freeze_call(call, name: Optional[str]) -> bool:
    """`name.eval()`, `name.train(False)`, `name.requires_grad_(False)` (name None: any receiver)."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value in FREEZE_METHODS):
        return False
    if name is not None and not _is_placement_chain(func.value, name):
        return False
    if func.attr.value == "eval":
        return not call.args
    return len(call.args) == 1 and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == "False"


def _freezing_loop(loop, name: str, part: bool = False) -> bool:
    """`for p in name.parameters(): p.requires_grad = False` (or `p.requires_grad_(False)`);
    part: also over a submodule's, `name.stem.parameters()`."""
    if not isinstance(loop, cst.For):
        return False
    it = loop.iter
    if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Attribute)
            and it.func.attr.value in ("parameters", "named_parameters")
            and (_rooted_at(it.func.value, name) if part
                 else isinstance(it.func.value, cst.Name) and it.func.value.value == name)):
        return False
    found = []

    class _F(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            if any(isinstance(t.target, cst.Attribute) and t.target.attr.value == "requires_grad"
                   for t in node.targets) and isinstance(node.value, cst.Name) and node.value.value == "False":
                found.append(node)

        def visit_Call(self, node: cst.Call) -> None:
            if _freeze_call(node, None) and node.func.attr.value == "requires_grad_":
                found.append(node)

    loop.body.visit(_F())
    return bool(found)


def _prepares(stmt, name: str) -> bool:
    """A statement that only places or freezes `name` (or an `if` of such statements)."""
    if isinstance(stmt, cst.If):
        inner = list(stmt.body.body) if isinstance(stmt.body, cst.IndentedBlock) else [stmt.body]
        return bool(inner) and stmt.orelse is None and all(_prepares(s, name) for s in inner)
    if isinstance(stmt, cst.For):
        return _freezing_loop(stmt, name)
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    if _is_placement(stmt, name) or _initialises(stmt, name):
        return True
    return all(isinstance(s, cst.Expr) and isinstance(s.value, cst.Call) and _freeze_call(s.value, name)
               for s in stmt.body)


# methods of a module (or one of its submodules) that change what fully_shard would see
RESTRUCTURING_METHODS = PLACEMENT_METHODS | {"load_state_dict", "requires_grad_", "apply"}


def _consumes(stmt, name: str) -> bool:
    """`stmt` takes `name`'s parameters (an optimizer), runs its forward or hands it to a
    function: a change to the module after it is not part of the build."""
    for call in calls_in(stmt):
        func = call.func
        if isinstance(func, cst.Name) and func.value == name:
            return True
        if isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters", "forward") \
                and _rooted_at(func.value, name):
            return True
        if any(isinstance(a.value, cst.Name) and a.value.value == name for a in call.args):
            return True
    return False


def _rooted_at(expr, name: str) -> bool:
    """`name`, `name.a.b`, `name.blocks[0].c`."""
    while isinstance(expr, (cst.Attribute, cst.Subscript)):
        expr = expr.value
    return isinstance(expr, cst.Name) and expr.value == name


def restructures(stmt, name: str) -> bool:
    """A statement after the build that changes the module fully_shard must see:
    `name.head = nn.Linear(...)`, `name.stem.requires_grad_(False)`,
    `name.load_state_dict(...)`, a loop freezing (part of) its parameters, or an `if`
    of such statements."""
    if isinstance(stmt, cst.If):
        inner = list(stmt.body.body) if isinstance(stmt.body, cst.IndentedBlock) else [stmt.body]
        return bool(inner) and stmt.orelse is None and all(restructures(s, name) for s in inner)
    if isinstance(stmt, cst.For):
        return _freezing_loop(stmt, name, part=True)
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for small in stmt.body:
        if isinstance(small, cst.Assign):
            if not all(isinstance(t.target, (cst.Attribute, cst.Subscript)) and _rooted_at(t.target, name)
                       for t in small.targets):
                return False
        elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            func = small.value.func
            if not (isinstance(func, cst.Attribute) and func.attr.value in RESTRUCTURING_METHODS
                    and _rooted_at(func.value, name)):
                return False
        else:
            return False
    return True


def _is_placement_chain(expr, name: str) -> bool:
    if isinstance(expr, cst.Name):
        return expr.value == name
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        return expr.func.attr.value in PLACEMENT_METHODS and _is_placement_chain(expr.func.value, name)
    return False


def _under(path, prefix) -> bool:
    return tuple(path[: len(prefix)]) == tuple(prefix)


def _params_receiving(fn: cst.FunctionDef, call: cst.Call, known: Set[str]):
    for param, arg in bind_args(fn, call):
        if isinstance(arg, cst.Name) and arg.value in known:
            yield param


def _first_method_call(node, method: str) -> Optional[cst.Call]:
    """The first `<x>.method(...)` call inside `node`, nested functions included."""
    for found in walk(node):
        if type(found) is cst.Call and isinstance(found.func, cst.Attribute) and found.func.attr.value == method:
            return found
    return None
