"""ScriptFacts: what is where in one training script.

Stages and lint rules ask these facts their questions ("which names hold models?",
"which loop calls backward?"); they never re-derive them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Set, Union

import libcst as cst

from .library_models import PEFT_WRAPPERS, LibraryModel, is_library_builder, library_model
from .model_classes import ClassRegistry, Container, build_registry
from fsdp2_retrofit.syntax.names import (
    DATALOADERS,
    FULLY_SHARD,
    NOT_OPTIMIZERS,
    OPTIMIZER_PREFIX,
    PLACEMENT_METHODS,
    SELF_RETURNING_METHODS,
    Resolver,
    assigned_names,
    calls_in,
    bind_args,
    code,
    is_main_guard,
    iterated_name,
    names_in,
    root_name,
)

Block = Union[cst.IndentedBlock, cst.Module]
Scope = Union[cst.FunctionDef, cst.Module]

STDLIB = set(getattr(sys, "stdlib_module_names", ())) | {"argparse", "logging", "collections", "dataclasses"}
LOG_CALLS = {"print"}
WRITE_CALLS = {"sys.stdout.write", "sys.stderr.write", "tqdm.tqdm.write", "tqdm.auto.tqdm.write"}
LOGGER_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}
DISTRIBUTED_WRAPPERS = {
    "torch.nn.parallel.DistributedDataParallel": "DistributedDataParallel",
    "torch.nn.DataParallel": "DataParallel",
    "torch.nn.parallel.DataParallel": "DataParallel",
    "torch.distributed.fsdp.FullyShardedDataParallel": "FullyShardedDataParallel (FSDP1)",
}


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


@dataclass
class OptimizerSite:
    name: str
    stmt: cst.SimpleStatementLine
    block: Block
    models: List[str]
    # statements before it that turn the models' parameters into its argument (param groups)
    feeders: List[cst.SimpleStatementLine] = field(default_factory=list)


@dataclass
class LoaderSite:
    name: str
    stmt: cst.SimpleStatementLine
    call: cst.Call
    block: Block
    dataset: Optional[cst.BaseExpression]
    shuffle: Optional[cst.BaseExpression]
    drop_last: Optional[cst.BaseExpression]
    kwargs_dict: Optional[cst.CSTNode]  # the dict(...) / {...} node the loader unpacks
    has_sampler: bool
    trains: bool = False


@dataclass
class LoopSite:
    node: cst.CSTNode  # For or While that calls backward()
    function: Optional[cst.FunctionDef]
    loader: Optional[str] = None


@dataclass
class LogSite:
    stmt: cst.SimpleStatementLine
    scope: Scope
    gated: bool


@dataclass
class ScriptFacts:
    path: Optional[str]
    module: cst.Module
    resolver: Resolver
    classes: ClassRegistry
    models: List[ModelSite]
    optimizers: List[OptimizerSite]
    loaders: List[LoaderSite]
    loops: List[LoopSite]
    logs: List[LogSite]
    forward_calls: List[cst.Call]
    # names that hold a model, per function (parameters that receive one included)
    model_names: Dict[Optional[cst.FunctionDef], Set[str]]
    # names that hold an optimizer, per function -> the model name it trains there (None: several)
    optimizer_names: Dict[Optional[cst.FunctionDef], Dict[str, Optional[str]]]
    entry_block: Optional[Block]
    entry_scope: Optional[Scope]
    distributed_init: Optional[cst.Call]
    mesh_name: Optional[str]
    rank_name: Optional[str]
    wrappers: List[tuple]  # (line, name) of DDP/DataParallel/FSDP1 uses
    root_shard: Dict[str, cst.SimpleStatementLine]  # model name -> its `fully_shard(name)` statement
    # torch.optim constructors inside classes that are not modules (a Trainer holding self.optimizer)
    class_optimizers: List[tuple]  # (class name, call)
    compiled_builds: List[cst.Call]  # `torch.compile(Net())`: built and compiled in one expression
    deep_copies: List[cst.Call]  # `copy.deepcopy(model)` of a trained model
    trainer_classes: List[tuple]  # (class name, call) of a class with a backward() loop given a model
    module_ctor_names: Set[str]
    # models no optimizer trains that the script freezes (requires_grad_(False), a loop setting
    # requires_grad = False, eval()): a distillation teacher
    frozen_models: List[ModelSite] = field(default_factory=list)
    # `ema = copy.deepcopy(model)` statements made in the model's block before it is sharded
    # (ModelSite.copy_of names the model); other deep copies stay in deep_copies only
    copies: List[ModelSite] = field(default_factory=list)
    # (what, call): copies made where the rewrite cannot shard them (AveragedModel, a class of
    # the script whose constructor deep-copies the model it is handed)
    hidden_copies: List[tuple] = field(default_factory=list)
    # like model_names, for the models optimizers train only (no frozen models, no copies)
    trained_names: Dict[Optional[cst.FunctionDef], Set[str]] = field(default_factory=dict)

    def model(self, name: str) -> Optional[ModelSite]:
        return next((m for m in self.models if m.name == name), None)

    def is_model_name(self, name: str, node: cst.CSTNode) -> bool:
        return name in self.model_names.get(self.resolver.enclosing_function(node), set())


def analyse(module: cst.Module, path: Optional[str] = None, origins=None, previous=None) -> ScriptFacts:
    """The facts of `module`; with `origins` (syntax.names.Origins) lines are the user's
    file's; `previous`, the Resolver of the tree `module` was edited from, saves walking
    what the edit kept."""
    resolver = Resolver(module, origins, previous)
    classes = build_registry(module, resolver, path)
    return _Analyser(module, resolver, classes, path).run()


AUTOCAST = {
    "torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast",
    "torch.cuda.amp.autocast", "torch.cpu.amp.autocast",
}
_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.half": "fp16"}


def autocast_dtypes(resolver: Resolver) -> Set[str]:
    """The low-precision dtypes ("bf16", "fp16") the script's autocast regions use."""
    out: Set[str] = set()
    for call in resolver.nodes(cst.Call):
        names = resolver.qnames(call)
        if not names & AUTOCAST:
            continue
        dtype = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "dtype"), None)
        if dtype is not None:
            found = {_DTYPES[q] for q in resolver.qnames(dtype) if q in _DTYPES}
            out |= found or {"unknown"}
            continue
        device = next((a.value for a in call.args if a.keyword is None or a.keyword.value == "device_type"), None)
        cpu = isinstance(device, cst.SimpleString) and "cpu" in device.value or "torch.cpu.amp.autocast" in names
        out.add("bf16" if cpu else "fp16")  # autocast's defaults
    return out


def training_loaders(module: cst.Module, resolver: Resolver) -> List[LoaderSite]:
    """The DataLoaders of a script, each marked whether a training loop reads it;
    needs no model facts (the lint asks this of scripts that are already sharded)."""
    analyser = _Analyser(module, resolver, ClassRegistry(), None)
    analyser.calls = resolver.nodes(cst.Call)
    loops = analyser._train_loops(resolver.nodes(cst.For) + resolver.nodes(cst.While))
    return analyser._loaders(resolver.nodes(cst.SimpleStatementLine), loops)


class _Analyser:
    def __init__(self, module, resolver: Resolver, classes: ClassRegistry, path):
        self.module = module
        self.r = resolver
        self.classes = classes
        self.path = path

    # -- collection ---------------------------------------------------------

    def run(self) -> ScriptFacts:
        calls: List[cst.Call] = self.r.nodes(cst.Call)
        loops = self.r.nodes(cst.For) + self.r.nodes(cst.While)
        stmts: List[cst.SimpleStatementLine] = self.r.nodes(cst.SimpleStatementLine)
        self.calls = calls
        bindings = self._module_bindings(stmts)
        optimizers = self._optimizers(stmts, bindings)
        models = self._trained_models(optimizers, bindings)
        trained_names = self._model_names(models)
        copies = self._copies(models, stmts)
        frozen = self._frozen_models(bindings, models, copies)
        model_names = self._model_names(models + copies + frozen)
        train_loops = self._train_loops(loops)
        loaders = self._loaders(stmts, train_loops)
        entry_block = models[0].block if models else None
        entry_scope = models[0].scope if models else None
        init_call = next(
            (c for c in calls if self.r.is_call_to(c, {"torch.distributed.init_process_group"})), None
        )
        mesh_name, rank_name = self._launch_names(stmts, entry_scope)
        facts = ScriptFacts(
            path=self.path,
            module=self.module,
            resolver=self.r,
            classes=self.classes,
            models=models,
            optimizers=[o for o in optimizers if o.models],
            loaders=loaders,
            loops=train_loops,
            logs=self._logs(stmts, rank_name),
            forward_calls=self._forward_calls(model_names),
            model_names=model_names,
            optimizer_names=self._optimizer_names(optimizers, model_names),
            entry_block=entry_block,
            entry_scope=entry_scope,
            distributed_init=init_call,
            mesh_name=mesh_name,
            rank_name=rank_name,
            wrappers=[
                (self.r.line(c), DISTRIBUTED_WRAPPERS[q])
                for c in calls
                for q in self.r.qnames(c)
                if q in DISTRIBUTED_WRAPPERS
            ],
            module_ctor_names={b[0] for b in bindings},
            root_shard=self._shard_statements(stmts),
            class_optimizers=self._class_optimizers(calls),
            compiled_builds=[
                c for c in calls
                if self.r.is_call_to(c, {"torch.compile"}) and c.args
                and _innermost_call(c.args[0].value) is not None
                and self._class_of(_innermost_call(c.args[0].value))
            ],
            deep_copies=[
                c for c in calls
                if self.r.is_call_to(c, {"copy.deepcopy"}) and c.args
                and isinstance(c.args[0].value, cst.Name)
                and c.args[0].value.value in trained_names.get(self.r.enclosing_function(c), set())
            ],
            trainer_classes=self._trainer_classes(calls, model_names),
            frozen_models=frozen,
            copies=copies,
            hidden_copies=self._hidden_copies(calls, trained_names),
            trained_names=trained_names,
        )
        for m in models + copies + frozen:
            m.sharded = m.name in facts.root_shard
        return facts

    def _module_bindings(self, stmts):
        """(name, stmt, class) for every `name = SomeModule(...)[.to(...)]` outside classes,
        also when a function of the script builds and returns it (`model = build_model()`)."""
        calls = []
        for stmt in stmts:
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            assign = stmt.body[0]
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
                continue
            if self.r.enclosing_class(stmt) is not None:
                continue
            value = assign.value
            if self.r.is_call_to(value, {"torch.compile"}) and value.args:
                value = value.args[0].value  # `model = torch.compile(Net())`: the shard stage splits it
            ctor = _innermost_call(value)
            if ctor is not None:
                calls.append((assign.targets[0].target.value, stmt, ctor))
        out = [(name, stmt, cls) for name, stmt, ctor in calls for cls in [self._class_of(ctor)] if cls]
        factories = self._factories(out)
        for name, stmt, ctor in calls:
            if isinstance(ctor.func, cst.Name) and ctor.func.value in factories:
                out.append((name, stmt, factories[ctor.func.value]))
        return out

    def _factories(self, bindings) -> Dict[str, str]:
        """Functions of the script that return a module they build: name -> its class."""
        out: Dict[str, str] = {}
        locals_of: Dict[Optional[cst.FunctionDef], Dict[str, str]] = {}
        for b in bindings:
            locals_of.setdefault(self.r.enclosing_function(b[1]), {})[b[0]] = b[2]
        returns_of: Dict[Optional[cst.FunctionDef], List[cst.Return]] = {}
        for r in self.r.nodes(cst.Return):
            returns_of.setdefault(self.r.enclosing_function(r), []).append(r)
        for fn in self.module.body:
            if not isinstance(fn, cst.FunctionDef):
                continue
            local = locals_of.get(fn, {})
            for ret in returns_of.get(fn, []):
                value = ret.value
                while _is_placement_chain(value, root_name(value) or "") and isinstance(value, cst.Call):
                    value = value.func.value  # `return model.to(device)`
                if isinstance(value, cst.Name) and value.value in local:
                    out[fn.name.value] = local[value.value]
                elif value is not None and _innermost_call(value) is not None:
                    cls = self._class_of(_innermost_call(value))
                    if cls:
                        out[fn.name.value] = cls
        return out

    def _class_of(self, call: cst.Call) -> Optional[str]:
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
                and name.split(".")[0] not in STDLIB
            ):
                return name
        return None

    def _trained_models(self, optimizers, bindings) -> List["ModelSite"]:
        """The first binding, in the optimizer's own function, of each name it trains."""
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
                if binding is not None:
                    seen.add((scope, name))
                    models.append(self._model_site(binding))
        order = {id(s): i for i, s in enumerate(self.r.nodes(cst.SimpleStatementLine))}
        models.sort(key=lambda m: order.get(id(m.stmt), 0))
        return models

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

    def _optimizers(self, stmts, bindings) -> List[OptimizerSite]:
        module_names = {b[0] for b in bindings}
        out = []
        for stmt in stmts:
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            assign = stmt.body[0]
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
                continue
            call = assign.value
            if not isinstance(call, cst.Call) or self.r.enclosing_class(stmt) is not None:
                continue
            is_torch_optim = (
                self.r.calls_prefix(call, OPTIMIZER_PREFIX)
                and not any(self.r.calls_prefix(call, p) for p in NOT_OPTIMIZERS)
            ) or self._is_getattr_optimizer(call)
            receiver = root_name(call.func) if isinstance(call.func, cst.Attribute) else None
            feeders: List[cst.SimpleStatementLine] = []
            if is_torch_optim:
                params = [a for a in call.args if (a.keyword is None and not a.star) or (
                    a.keyword is not None and a.keyword.value == "params")][:1]
                models = self._fed_models(_ordered_names(params), stmt, module_names, feeders)
            elif receiver in module_names and "optim" in call.func.attr.value.lower():
                models = [receiver]  # model.configure_optimizers(...)
            else:
                continue
            block = self.r.block_of(stmt)
            out.append(
                OptimizerSite(assign.targets[0].target.value, stmt, block, models, feeders)
            )
        return out

    def _is_getattr_optimizer(self, call: cst.Call) -> bool:
        """`getattr(torch.optim, args.optim)(model.parameters(), ...)`"""
        inner = call.func
        return (
            isinstance(inner, cst.Call)
            and isinstance(inner.func, cst.Name)
            and inner.func.value == "getattr"
            and bool(inner.args)
            and "torch.optim" in self.r.qnames(inner.args[0].value)
        )

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
        return ModelSite(
            name=name,
            stmt=stmt,
            block=block,
            scope=scope,
            class_name=cls,
            top=top,
            shard_anchor=self._shard_anchor(name, top, block, frozen),
            containers=[c for c in containers if c not in tied],
            tied_containers=tied,
            library=library,
        )

    def _library_model(self, stmt, cls: Optional[str]) -> Optional[LibraryModel]:
        """The layout of a model a library builds; the call is read when this statement
        makes it (a factory function's model is known by the builder's name only)."""
        if not cls or not is_library_builder(cls):
            return None
        value = stmt.body[0].value
        if self.r.is_call_to(value, {"torch.compile"}) and value.args:
            value = value.args[0].value
        call = _innermost_call(value)
        found = library_model(cls, call if call is not None and cls in self.r.qnames(call) else None, self.r)
        name = stmt.body[0].targets[0].target.value
        for save in self.calls:  # `model.push_to_hub(...)`, in any function that names it `model`
            func = save.func
            if (isinstance(func, cst.Attribute) and func.attr.value == "push_to_hub"
                    and isinstance(func.value, cst.Name) and func.value.value == name):
                return replace(found, refusal_at=save, refusal=(
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
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            assign = stmt.body[0]
            call = _innermost_call(assign.value)  # also `copy.deepcopy(model).eval()`
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name) or call is None:
                continue
            # AveragedModel(model, ...) deep-copies the model into its `.module`: that is what gets sharded
            averaged = self.r.is_call_to(call, {"torch.optim.swa_utils.AveragedModel"})
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
            known = trained_names.get(self.r.enclosing_function(call), set())
            if not (call.args and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value in known):
                continue
            if self.r.is_call_to(call, {"torch.optim.swa_utils.AveragedModel"}):
                out.append(("AveragedModel", call))
            elif isinstance(call.func, cst.Name) and call.func.value in copying:
                out.append((call.func.value, call))
        return out

    def _shard_anchor(self, name: str, stmt, block, frozen: bool = False) -> cst.CSTNode:
        """The last statement that builds or places the model before it is used; for a
        frozen model or a copy, also what freezes it (eval(), requires_grad_(False), a
        loop over its parameters), up to the first other statement that uses it."""
        body = list(block.body)
        anchor = stmt
        for later in body[body.index(stmt) + 1 :]:
            if frozen and _prepares(later, name):
                anchor = later
                continue
            if frozen and name in names_in(later):
                break  # a load_state_dict, a forward: after sharding, as for a trained model
            if isinstance(later, (cst.For, cst.While, cst.FunctionDef, cst.With, cst.Try)):
                break
            if _is_placement(later, name) or _initialises(later, name):
                anchor = later
            elif name in assigned_names(later):
                break  # rebound by something else (torch.compile, a wrapper): shard before it
        return anchor

    def _model_names(self, models: List[ModelSite]) -> Dict[Optional[cst.FunctionDef], Set[str]]:
        """Model names per function, following calls that pass a model as an argument."""
        names: Dict[Optional[cst.FunctionDef], Set[str]] = {}
        for m in models:
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
        self._add_aliases(names)
        return names

    def _add_aliases(self, names) -> None:
        """`raw_model = model`, `raw_model = model.module if ddp else model`: another name
        for the same model, in the same function."""
        for stmt in self.r.nodes(cst.SimpleStatementLine):
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            assign = stmt.body[0]
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
                continue
            function = self.r.enclosing_function(stmt)
            known = names.get(function, set())
            if known and _aliases_model(assign.value, known):
                known.add(assign.targets[0].target.value)

    def _local_calls(self):
        """(call, function) for every call of a top-level function of the script."""
        functions = {s.name.value: s for s in self.module.body if isinstance(s, cst.FunctionDef)}
        for call in self.calls:
            if isinstance(call.func, cst.Name) and call.func.value in functions:
                yield call, functions[call.func.value]

    def _optimizer_names(self, optimizers, model_names):
        """Optimizer names per function, following calls; each mapped to its model's name there."""
        names: Dict[Optional[cst.FunctionDef], Dict[str, Optional[str]]] = {}
        for opt in optimizers:
            if opt.models:
                fn = self.r.enclosing_function(opt.stmt)
                names.setdefault(fn, {})[opt.name] = opt.models[0] if len(opt.models) == 1 else None
        changed = True
        while changed:
            changed = False
            for call, callee in self._local_calls():
                known = names.get(self.r.enclosing_function(call), {})
                bound = list(bind_args(callee, call))
                for param, arg in bound:
                    if not (isinstance(arg, cst.Name) and arg.value in known) or param in names.get(callee, {}):
                        continue
                    model = known[arg.value]
                    there = [p for p, a in bound if isinstance(a, cst.Name) and a.value == model]
                    callee_models = sorted(model_names.get(callee, set()))
                    names.setdefault(callee, {})[param] = (
                        there[0] if there else callee_models[0] if len(callee_models) == 1 else None
                    )
                    changed = True
        return names

    def _train_loops(self, loops) -> List[LoopSite]:
        """Innermost loops that call backward(), directly or through a per-step helper
        of the script (`train_step(model, batch, optimizer)`, no loop of its own).

        Works from the calls up (one walk of ancestors per backward() call), not by
        visiting every loop's body."""
        top = {fn for fn in self.module.body if isinstance(fn, cst.FunctionDef)}
        backward = [c for c in self.calls if isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward"]
        chains = {id(c): self._loop_chain(c) for c in backward}
        helpers = set()
        for fn in top:
            mine = [c for c in backward if chains[id(c)][1] is fn]
            if mine and not any(chains[id(c)][0] for c in mine):
                helpers.add(fn.name.value)
        triggers = backward + [c for c in self.calls if isinstance(c.func, cst.Name) and c.func.value in helpers]
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

    def _loaders(self, stmts, train_loops: List[LoopSite]) -> List[LoaderSite]:
        out = []
        iterated = {l.loader for l in train_loops if l.loader}
        for loop in train_loops:
            if isinstance(loop.node, cst.For):
                iterated |= names_in(loop.node.iter)
            iterated |= _next_call_names(loop.node, self.r)
            # micro-batches split off each batch of an outer loop: that loop reads the data
            for outer in self.r.ancestors(loop.node):
                if isinstance(outer, cst.FunctionDef):
                    break
                if isinstance(outer, cst.For):
                    iterated |= names_in(outer.iter)
        # `it = iter(loader)` (or a generator over it) read inside a training loop
        for stmt in stmts:
            if assigned_names(stmt) & iterated and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
                iterated |= names_in(stmt.body[0].value)
        passed = self._names_passed_to_loop_functions(train_loops)
        for stmt in stmts:
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            assign = stmt.body[0]
            call = assign.value
            if not self.r.is_call_to(call, DATALOADERS) or not isinstance(assign.targets[0].target, cst.Name):
                continue
            name = assign.targets[0].target.value
            args = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
            kwargs_dict = None
            for a in call.args:
                if a.star == "**" and isinstance(a.value, cst.Name):
                    kwargs_dict = self._dict_bound_before(a.value.value, stmt)
                    if kwargs_dict is not None:
                        for key, value in _dict_entries(kwargs_dict):
                            args.setdefault(key, value)
            positional = [a.value for a in call.args if a.keyword is None and not a.star]
            dataset = args.get("dataset", positional[0] if positional else None)
            out.append(
                LoaderSite(
                    name=name,
                    stmt=stmt,
                    call=call,
                    block=self.r.block_of(stmt),
                    dataset=dataset,
                    shuffle=args.get("shuffle", positional[2] if len(positional) > 2 else None),
                    drop_last=args.get("drop_last"),
                    kwargs_dict=kwargs_dict,
                    has_sampler="sampler" in args or "batch_sampler" in args,
                    trains=name in iterated or name in passed,
                )
            )
        return out

    def _names_passed_to_loop_functions(self, train_loops) -> Set[str]:
        """Loader names handed to a function whose loop trains (train_one_epoch(model, loader))."""
        out: Set[str] = set()
        for loop in train_loops:
            if loop.function is None or not loop.loader:
                continue
            for call in self.calls:
                if isinstance(call.func, cst.Name) and call.func.value == loop.function.name.value:
                    for param, arg in bind_args(loop.function, call):
                        if param == loop.loader and isinstance(arg, cst.Name):
                            out.add(arg.value)
        return out

    def _dict_bound_before(self, name: str, stmt) -> Optional[cst.CSTNode]:
        block = self.r.block_of(stmt)
        if block is None:
            return None
        body = list(block.body)
        for earlier in reversed(body[: body.index(stmt)]):
            if name in assigned_names(earlier):
                value = earlier.body[0].value if isinstance(earlier.body[0], cst.Assign) else None
                if isinstance(value, cst.Dict) or (
                    isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "dict"
                ):
                    return value
                return None
        return None

    def _launch_names(self, stmts, entry_scope):
        """The mesh and the rank names of the entry scope (the script's own, e.g.
        `rank = int(os.environ["RANK"])`, or the launch stage's)."""
        from .process_group import is_rank_value

        mesh = rank = None
        entry_fn = entry_scope if isinstance(entry_scope, cst.FunctionDef) else None
        for stmt in stmts:
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            if entry_scope is not None and self.r.enclosing_function(stmt) is not entry_fn:
                continue
            assign = stmt.body[0]
            value, target = assign.value, assign.targets[0].target
            if isinstance(target, cst.Name) and self.r.is_call_to(
                value, {"torch.distributed.device_mesh.init_device_mesh"}
            ):
                mesh = mesh or target.value
            pairs = []
            if isinstance(target, cst.Tuple) and isinstance(value, cst.Tuple):
                pairs = list(zip(target.elements, value.elements))
                pairs = [(t.value, v.value) for t, v in pairs]
            else:
                pairs = [(target, value)]
            for t, v in pairs:
                if isinstance(t, cst.Name) and is_rank_value(v, self.r):
                    rank = rank or t.value
        return mesh, rank

    def _logs(self, stmts, rank_name) -> List[LogSite]:
        out = []
        for stmt in stmts:
            if not all(isinstance(s, cst.Expr) and self._is_log_call(s.value) for s in stmt.body):
                continue
            if self.r.enclosing_class(stmt) is not None:
                continue
            out.append(
                LogSite(
                    stmt=stmt,
                    scope=self.r.enclosing_function(stmt) or self.module,
                    gated=self._is_rank_gated(stmt),
                )
            )
        return out

    def _is_log_call(self, node) -> bool:
        if not isinstance(node, cst.Call):
            return False
        if isinstance(node.func, cst.Name) and node.func.value in LOG_CALLS:
            return True
        if self.r.qnames(node) & WRITE_CALLS:
            return True
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in LOGGER_METHODS:
            base = node.func.value
            if any(q.startswith("logging") for q in self.r.qnames(base)):
                return True
            base_name = root_name(base)
            return bool(base_name) and ("log" in base_name.lower())
        return False

    def _is_rank_gated(self, node) -> bool:
        for anc in self.r.ancestors(node):
            if isinstance(anc, (cst.If,)) and _mentions_rank(anc.test):
                return True
            if isinstance(anc, cst.FunctionDef):
                return False
        return False

    def _forward_calls(self, model_names) -> List[cst.Call]:
        out = []
        for call in self.calls:
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "forward"):
                continue
            target = func.value
            if isinstance(target, cst.Name) and target.value in model_names.get(
                self.r.enclosing_function(call), set()
            ):
                out.append(call)
        return out

    def _trainer_classes(self, calls, model_names) -> List[tuple]:
        """Script classes (not modules) whose methods call backward(), built with a model."""
        trainers = {
            c.name.value
            for c in self.module.body
            if isinstance(c, cst.ClassDef)
            and not self.classes.is_module_class(c.name.value)
            and _calls_method(c.body, "backward", into_functions=True)
        }
        out = []
        for call in calls:
            if isinstance(call.func, cst.Name) and call.func.value in trainers:
                known = model_names.get(self.r.enclosing_function(call), set())
                if any(isinstance(a.value, cst.Name) and a.value.value in known for a in call.args):
                    out.append((call.func.value, call))
        return out

    def _class_optimizers(self, calls) -> List[tuple]:
        out = []
        for call in calls:
            cls = self.r.enclosing_class(call)
            if cls is None or self.classes.is_module_class(cls.name.value):
                continue
            if self.r.calls_prefix(call, OPTIMIZER_PREFIX) and not any(
                self.r.calls_prefix(call, p) for p in NOT_OPTIMIZERS
            ):
                out.append((cls.name.value, call))
        return out

    def _shard_statements(self, stmts) -> Dict[str, cst.SimpleStatementLine]:
        out = {}
        for stmt in stmts:
            for small in stmt.body:
                call = small.value if isinstance(small, cst.Expr) else None
                if (
                    isinstance(call, cst.Call)
                    and self.r.qnames(call) & FULLY_SHARD
                    and call.args
                    and isinstance(call.args[0].value, cst.Name)
                ):
                    out[call.args[0].value.value] = stmt
                elif (  # `fully_shard(ema.module)`: an AveragedModel's copy
                    isinstance(call, cst.Call)
                    and self.r.qnames(call) & FULLY_SHARD
                    and call.args
                    and isinstance(call.args[0].value, cst.Attribute)
                    and call.args[0].value.attr.value == "module"
                    and isinstance(call.args[0].value.value, cst.Name)
                ):
                    out[call.args[0].value.value.value + ".module"] = stmt
        return out


# -- small helpers -----------------------------------------------------------


def _aliases_model(expr, known: Set[str]) -> bool:
    """`model`, `model.module`, `model._orig_mod`, or a conditional choosing one of them."""
    if isinstance(expr, cst.IfExp):
        return _aliases_model(expr.body, known) or _aliases_model(expr.orelse, known)
    if isinstance(expr, cst.Attribute) and expr.attr.value in ("module", "_orig_mod"):
        expr = expr.value
    return isinstance(expr, cst.Name) and expr.value in known


def _innermost_call(expr) -> Optional[cst.Call]:
    """`Net(...)` for `Net(...)`, `Net(...).to(d)`, `Net(...).cuda().float()`,
    `Net().cuda() if use_cuda else Net()`."""
    if isinstance(expr, cst.IfExp):
        return _innermost_call(expr.body) or _innermost_call(expr.orelse)
    while isinstance(expr, cst.Call):
        func = expr.func
        if isinstance(func, cst.Attribute) and func.attr.value in SELF_RETURNING_METHODS and isinstance(func.value, cst.Call):
            expr = func.value
            continue
        return expr
    return None


def _is_placement(stmt, name: str) -> bool:
    """`m.to(d)`, `m = m.cuda()`, or an `if` whose body only does such things."""
    if isinstance(stmt, cst.If):
        inner = list(stmt.body.body) if isinstance(stmt.body, cst.IndentedBlock) else [stmt.body]
        return bool(inner) and all(_is_placement(s, name) for s in inner) and stmt.orelse is None
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


def _initialises(stmt, name: str) -> bool:
    """`model.apply(init_fn)`: an in-place (re)initialisation, done before sharding."""
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


def _freezing_loop(loop, name: str) -> bool:
    """`for p in name.parameters(): p.requires_grad = False` (or `p.requires_grad_(False)`)."""
    if not isinstance(loop, cst.For):
        return False
    it = loop.iter
    if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Attribute)
            and it.func.attr.value in ("parameters", "named_parameters")
            and isinstance(it.func.value, cst.Name) and it.func.value.value == name):
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


def _is_placement_chain(expr, name: str) -> bool:
    if isinstance(expr, cst.Name):
        return expr.value == name
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        return expr.func.attr.value in PLACEMENT_METHODS and _is_placement_chain(expr.func.value, name)
    return False


def _ordered_names(args) -> List[str]:
    seen: List[str] = []

    class _N(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            if n.value not in seen:
                seen.append(n.value)

    for a in args:
        a.value.visit(_N())
    return seen


def _under(path, prefix) -> bool:
    return tuple(path[: len(prefix)]) == tuple(prefix)


def _params_receiving(fn: cst.FunctionDef, call: cst.Call, known: Set[str]):
    for param, arg in bind_args(fn, call):
        if isinstance(arg, cst.Name) and arg.value in known:
            yield param


def _calls_method(node, method: str, into_functions: bool = False) -> bool:
    found = []

    class _M(cst.CSTVisitor):
        def visit_FunctionDef(self, n) -> bool:
            return into_functions

        def visit_Call(self, n: cst.Call) -> None:
            if isinstance(n.func, cst.Attribute) and n.func.attr.value == method:
                found.append(n)

    node.visit(_M())
    return bool(found)


def _next_call_names(loop, resolver: Resolver) -> Set[str]:
    """Names handed to `next(...)` inside a loop: iterators it draws batches from."""
    found: Set[str] = set()
    for node in resolver.descendants(loop, cst.Call):
        if isinstance(node.func, cst.Name) and node.func.value == "next" and node.args:
            found.update(names_in(node.args[0].value))
    return found


def _dict_entries(node):
    if isinstance(node, cst.Dict):
        for el in node.elements:
            if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
                yield el.key.evaluated_value, el.value
    elif isinstance(node, cst.Call):
        for a in node.args:
            if a.keyword is not None:
                yield a.keyword.value, a.value


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


def _mentions_rank(test) -> bool:
    text = code(test)
    return any(k in text for k in ("rank", "master", "is_main"))
