"""Models: the names bound to nn.Module instances (built here, by a factory function
or a library), which an optimizer trains, copies and frozen models, where each is
sharded, and the forward calls and trainer classes that use them.

Three questions have modules of their own, each asked through one collaborator per
analysis: which class a build makes (model_builds.BuildClasses), where a build ends
and fully_shard goes (shard_anchors.ShardAnchors), and which names hold each model
per function (model_names.ModelNames)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Dict, List, Optional, Set

import libcst as cst

from .library_models import PEFT_WRAPPERS, LibraryModel, is_library_builder, library_model
from .model_builds import BuildClasses
from .model_classes import ClassRegistry, Container, build_registry
from .model_names import ModelNames
from .flow import innermost_call
from .shard_anchors import _freeze_call, _freezing_loop, _is_placement, _late_init
from .site_analysis import Block, Scope, SiteAnalysis
from fsdp2_retrofit.syntax.names import (
    Resolver,
    assigned_names,
    calls_in,
    code,
    instance_attribute,
    names_in,
    root_name,
    walk,
)
from fsdp2_retrofit.syntax.torch_api import AVERAGED_MODEL, FULLY_SHARD, TORCH_COMPILE


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

    @cached_property
    def builds(self) -> BuildClasses:
        """Which module class each build call makes (model_builds.py), made once."""
        return BuildClasses(self)

    @cached_property
    def model_holders(self) -> ModelNames:
        """The names holding each model per function (model_names.py), made once."""
        return ModelNames(self)

    def _alternatives(self, name: str, stmt, top) -> tuple:
        """(the classes `name` may hold, whether its blocks are decided at run time): a
        table's entries, or the classes the branches of the if/elif around it build."""
        value = getattr(stmt.body[0], "value", None)
        ctor = innermost_call(value) if value is not None else None
        chosen = self.builds.table_classes(ctor) if ctor is not None else []
        if chosen:
            return chosen, True
        aliased = self.builds.aliased_classes(self.handed_back(ctor) or ctor) if ctor is not None else []
        if len(aliased) > 1:
            return aliased, True
        # `A(...) if c else B(...)`, a function of the script returning one of several: followed by value
        chosen = self.builds.chosen_classes(value) if value is not None else []
        if len(chosen) > 1:
            return chosen, self._layouts_differ(chosen)
        if top is stmt:
            return [], False
        span = self.r.span(top)
        classes: List[str] = []
        for other, other_stmt, cls in getattr(self, "_bindings", ()):
            if other == name and span[0] <= self.r.order(other_stmt) <= span[1] and cls not in classes:
                classes.append(cls)
        if len(classes) < 2 or any(is_library_builder(c) for c in classes):
            return [], False
        return classes, self._layouts_differ(classes)

    def _layouts_differ(self, classes: List[str]) -> bool:
        """Whether the repeated blocks of the classes differ (the shard units are then found at run time)."""
        layouts = {
            tuple(sorted((c.path, c.block_class) for c in self.classes.block_containers(cls) if c.block_class))
            for cls in classes
        }
        return len(layouts) > 1

    def _trained_models(self, optimizers, bindings) -> List["ModelSite"]:
        """The first binding, in the optimizer's own function, of each name it trains."""
        self._bindings = bindings  # read by _alternatives
        # classes (not modules) whose methods build an optimizer (a trainer's run()): fully_shard
        # goes before any construction of them (ShardAnchors.anchor)
        self.anchors.building_classes = {
            cls.name.value for opt in optimizers for fn in [self.r.enclosing_function(opt.stmt)] if fn is not None
            for cls in [self.r.enclosing_class(fn)] if cls is not None
        }
        # ShardAnchors.anchor stops before a branch building one
        self.anchors.optimizer_stmts = {id(opt.stmt) for opt in optimizers}
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
                    models.append(self._model_site(self.wrapping(binding, bindings)))
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
        anchor = self.anchors.anchor(name, top, block, frozen)
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
            rebound_by=None if frozen else self.anchors.rebound_by(name, top, block),
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
                shard_anchor=self.anchors.anchor(name, stmt, source.block, frozen=True),
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
    return ModelAnalysis(module, resolver, classes).builds.bindings(resolver.nodes(cst.SimpleStatementLine))


def trained_models(module: cst.Module, resolver: Resolver, optimizers, bindings,
                   classes: Optional[ClassRegistry] = None) -> List[ModelSite]:
    """The models of `bindings` that `optimizers` (optimizers.optimizer_sites) train."""
    classes = classes if classes is not None else build_registry(module, resolver, None)
    return ModelAnalysis(module, resolver, classes)._trained_models(optimizers, bindings)


def _under(path, prefix) -> bool:
    return tuple(path[: len(prefix)]) == tuple(prefix)


def _first_method_call(node, method: str) -> Optional[cst.Call]:
    """The first `<x>.method(...)` call inside `node`, nested functions included."""
    for found in walk(node):
        if type(found) is cst.Call and isinstance(found.func, cst.Attribute) and found.func.attr.value == method:
            return found
    return None
