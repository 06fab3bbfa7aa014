"""ScriptFacts: what is where in one training script, assembled from the per-site
analyses (models.py, optimizers.py, loops.py, data.py, logs.py, launch.py).

Stages and lint rules ask these facts their questions ("which names hold models?",
"which loop calls backward?"); they never re-derive them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import libcst as cst

from .closures import nonlocal_rebinds
from .held_values import Lost
from .data import DataAnalysis, LoaderSite, training_loaders  # noqa: F401  (importable from here)
from .launch import DISTRIBUTED_WRAPPERS, LaunchAnalysis  # noqa: F401
from .logs import LogAnalysis, LogSite
from .loops import LoopSite
from .model_classes import ClassRegistry, build_registry, called_methods
from .flow import innermost_call as _innermost_call
from .models import ModelAnalysis, ModelSite
from .optimizers import OptimizerAnalysis, OptimizerSite
from .site_analysis import Block, Scope
from fsdp2_retrofit.syntax.names import Resolver, instance_attribute
from fsdp2_retrofit.syntax.torch_api import AUTOCAST, TORCH_COMPILE


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
    # `model, opt = build(cfg)`: the call, in the entry block, of the helper that builds and
    # returns the model (the launch goes before it; fully_shard stays in the helper)
    entry_call: Optional[cst.Call]
    # a helper that returns the model to something other than one `a, b = helper()` assignment
    unfollowed_return: Optional[cst.FunctionDef]
    distributed_init: Optional[cst.Call]
    mesh_name: Optional[str]
    rank_name: Optional[str]
    wrappers: List[tuple]  # (line, name) of DDP/DataParallel/FSDP1 uses
    root_shard: Dict[str, cst.SimpleStatementLine]  # model name -> its `fully_shard(name)` statement
    # torch.optim constructors inside classes that are not modules (a Trainer holding self.optimizer)
    class_optimizers: List[tuple]  # (class name, call)
    compiled_builds: List[cst.Call]  # `torch.compile(Net())`: built and compiled in one expression
    deep_copies: List[cst.Call]  # `copy.deepcopy(model)` of a trained model
    trainer_classes: List[tuple]  # (label, call) of a sibling module's class with a backward() loop given a model
    module_ctor_names: Set[str]
    # models no optimizer trains that the script freezes (requires_grad_(False), a loop setting
    # requires_grad = False, eval()): a distillation teacher
    frozen_models: List[ModelSite] = field(default_factory=list)
    # (construction, node, why) of the writer objects (csv, SummaryWriter, a kept-open handle) that
    # write one path on every rank and cannot go to rank 0 whole (analysis/logs.py)
    unsafe_writers: List[tuple] = field(default_factory=list)
    # (name, statement) of every `name = SomeModule(...)` outside classes, trained or not
    module_builds: List[tuple] = field(default_factory=list)
    # `ema = copy.deepcopy(model)` statements made in the model's block before it is sharded
    # (ModelSite.copy_of names the model); other deep copies stay in deep_copies only
    copies: List[ModelSite] = field(default_factory=list)
    # (what, call): copies made where the rewrite cannot shard them (AveragedModel, a class of
    # the script whose constructor deep-copies the model it is handed)
    hidden_copies: List[tuple] = field(default_factory=list)
    # like model_names, for the models optimizers train only (no frozen models, no copies)
    trained_names: Dict[Optional[cst.FunctionDef], Set[str]] = field(default_factory=dict)
    # (assignment, name): a nested function rebinding a model of the function around it (`nonlocal`)
    closure_rebinds: List[tuple] = field(default_factory=list)
    # id() of every DataLoader call whose value reaches a training loop (named or not: `return DataLoader(...)`)
    training_loader_calls: Set[int] = field(default_factory=set)
    # (function, name) -> (node, why): where an optimizer handed to a function or object was lost
    # (held_values: a call or construction handing that parameter something else)
    lost_optimizers: Lost = field(default_factory=dict)
    # analysis/penalties.py's answer for these facts, made once (the shard stage, its blockers and
    # penalty_reshard all ask)
    penalty_cache: Optional[list] = field(default=None, repr=False)
    # the analysis these facts were assembled by (its value flow, functions, sharding facts)
    analysis: Optional["_Analyser"] = field(default=None, repr=False)

    def model(self, name: str) -> Optional[ModelSite]:
        return next((m for m in self.models if m.name == name), None)

    def is_model_name(self, name: str, node: cst.CSTNode) -> bool:
        return name in self.model_names.get(self.resolver.enclosing_function(node), set())

    def model_held(self, expr: cst.BaseExpression) -> Optional[ModelSite]:
        """The model `expr` (a name or `self.attr`) holds where it is read, among each model's names there."""
        spelled = expr.value if type(expr) is cst.Name else instance_attribute(expr)
        if spelled is None:
            return None
        fn = self.resolver.enclosing_function(expr)
        return next((m for m in self.models if spelled in m.names.get(fn, ())), None)

    def instance_class(self, expr: cst.BaseExpression):
        """The ClassInfo of the script's or a sibling module's class whose instance `expr` holds
        (`criterion = SupConLoss(...)`; `self.trainer = Trainer(net)`), by value; None when no
        origin of `expr` is a construction of a class the registry read."""
        top = self.classes.top_level.get("")
        if top is None or not isinstance(expr, (cst.Name, cst.Attribute)):
            return None
        # the flow is flow-insensitive: a name holds the same values wherever its function reads it, and
        # `self.x` wherever its class does; asked once per spelling and scope (every call of a script)
        from .rank_values import scope_key

        key = scope_key(self.resolver, expr, expr)
        cache = self.resolver.derived.setdefault("instance_class", {})
        if key is not None and key in cache:
            return cache[key]
        found = None
        for origin in self.analysis.flow.values(expr):
            node = origin[0] if isinstance(origin, tuple) else origin
            if isinstance(node, cst.Call):
                info = self.classes.get(top[1].of(node.func))
                if info is not None:
                    found = info
                    break
        if key is not None:
            cache[key] = found
        return found

    def methods_called_on(self, model: ModelSite, info) -> List[str]:
        """The methods of `info` (the model's class) the script calls on any name that
        holds `model` where it is called (`m = model.to(device)`; `m.generate(...)`)."""
        def holds(receiver, call) -> bool:
            return type(receiver) is cst.Name and receiver.value in model.names.get(
                self.resolver.enclosing_function(call), set())

        return called_methods(holds, info, self.resolver)


def analyse(module: cst.Module, path: Optional[str] = None, origins=None, previous=None) -> ScriptFacts:
    """The facts of `module`; with `origins` (syntax.names.Origins) lines are the user's
    file's; `previous`, the Resolver of the tree `module` was edited from, saves walking
    what the edit kept."""
    resolver = Resolver(module, origins, previous)
    classes = build_registry(module, resolver, path)
    return _Analyser(module, resolver, classes, path).run()


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


class _Analyser(ModelAnalysis, OptimizerAnalysis, DataAnalysis, LogAnalysis, LaunchAnalysis):
    """Every per-site analysis over one script, assembled into its ScriptFacts (check asks the
    DataAnalysis part and the sharding facts of the same base directly)."""

    # -- collection ---------------------------------------------------------

    def run(self) -> ScriptFacts:
        calls: List[cst.Call] = self.r.nodes(cst.Call)
        stmts: List[cst.SimpleStatementLine] = self.r.nodes(cst.SimpleStatementLine)
        self.calls = calls
        bindings = self.builds.bindings(stmts)
        optimizers = self._optimizers(stmts, bindings)
        models = self._trained_models(optimizers, bindings)
        trained_names = self.model_holders.of(models)
        copies = self._copies(models, stmts)
        frozen = self._frozen_models(bindings, models, copies)
        model_names = self.model_holders.of(models + copies + frozen)
        train_loops = self.train_loops()
        loaders = self._loaders(stmts, train_loops)
        entry_block, entry_scope, entry_call, unfollowed_return = (
            self._entry(models[0]) if models else (None, None, None, None)
        )
        init_call = self._distributed_init(calls)
        mesh_name, rank_name = self._launch_names(stmts, entry_scope, models[0].scope if entry_call else None)
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
            entry_call=entry_call,
            unfollowed_return=unfollowed_return,
            distributed_init=init_call,
            mesh_name=mesh_name,
            rank_name=rank_name,
            wrappers=self._wrappers(calls),
            module_ctor_names={b[0] for b in bindings},
            root_shard=self._shard_statements(stmts),
            class_optimizers=self._class_optimizers(calls),
            compiled_builds=[
                c for c in calls
                if self.r.is_call_to(c, TORCH_COMPILE) and c.args
                and _innermost_call(c.args[0].value) is not None
                and self.builds.class_of(_innermost_call(c.args[0].value))
            ],
            deep_copies=[
                c for c in calls
                if self.r.is_call_to(c, {"copy.deepcopy"}) and c.args
                and isinstance(c.args[0].value, cst.Name)
                and c.args[0].value.value in trained_names.get(self.r.enclosing_function(c), set())
            ],
            trainer_classes=self._trainer_classes(calls, model_names, bindings),
            unsafe_writers=getattr(self, "unsafe_writers", []),
            frozen_models=frozen,
            module_builds=[(b[0], b[1]) for b in bindings],
            copies=copies,
            hidden_copies=self._hidden_copies(calls, trained_names),
            trained_names=trained_names,
            closure_rebinds=nonlocal_rebinds(self.r, model_names),
            training_loader_calls=self._loaders_feeding(train_loops),
            lost_optimizers=self.lost_optimizers,
            analysis=self,
        )
        for m in models + copies + frozen:
            m.sharded = m.name in facts.root_shard
            m.names = self.model_holders.of([m])
        return facts

