"""FSDP1 (FullyShardedDataParallel) in a script: what each wrap asks for, the
state_dict_type blocks, and every other use of the FSDP1 API.

The migrate_fsdp1 stage asks these questions; nothing here edits. Names are
resolved through imports (any spelling, `FSDP` alias); an argument given as a
name is seen through its one assignment (`policy = functools.partial(...)`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from .facts import ScriptFacts
from .fsdp1_values import ValueReader
from fsdp2_retrofit.syntax.names import code, keyword_arg
from fsdp2_retrofit.syntax.torch_api import FSDP1_CLASSES
from fsdp2_retrofit.syntax.torch_api import SHARDED_GRAD_SCALER as SCALER
# FSDP1-only names exported by torch.distributed.fsdp (the FSDP2 ones are fully_shard,
# MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy, FSDPModule, register_fsdp_forward_method, ...)
FSDP1_NAMES = {
    "FullyShardedDataParallel", "MixedPrecision", "CPUOffload", "ShardingStrategy", "BackwardPrefetch",
    "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
    "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig",
    "StateDictConfig", "OptimStateDictConfig", "StateDictSettings", "ShardedGradScaler",
}
FSDP1_MODULES = (
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp.sharded_grad_scaler",
)
POLICIES = {
    "transformer_auto_wrap_policy": "transformer",
    "lambda_auto_wrap_policy": "lambda",
    "size_based_auto_wrap_policy": "size",
    "ModuleWrapPolicy": "module",
}
DTYPES = {
    "torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.half": "float16",
    "torch.float32": "float32", "torch.float": "float32",
}
# keyword -> why it is dropped (FSDP2 has no such setting, or does it itself)
DROPPED = {
    "device_id": "fully_shard shards on the mesh's device; the model is moved there before sharding",
    "use_orig_params": "FSDP2 always keeps the original parameters (one DTensor each, no FlatParameter)",
    "sync_module_states": "every rank builds the model from the same seed; FSDP2 does not broadcast rank 0's "
    "weights (with different initial weights per rank, load a checkpoint after sharding instead)",
    "limit_all_gathers": "FSDP2 bounds its all-gather memory by itself (no rate limiter needed)",
    "backward_prefetch": "FSDP2 prefetches the next unit in backward by default "
    "(explicit control: FSDPModule.set_modules_to_backward_prefetch)",
    "forward_prefetch": "FSDP2 overlaps the next all-gather with forward by default "
    "(explicit control: FSDPModule.set_modules_to_forward_prefetch)",
    "process_group": "the device mesh replaces the process group",
    "device_mesh": "the device mesh is built by the rewrite (--hsdp for a 2-D mesh)",
}
# keyword -> why it is refused
REFUSED = {
    "param_init_fn": "FSDP2 has no parameter-init hook; build on the meta device, shard, then "
    "to_empty() and initialise (rewrite --meta-init from the single-GPU script)",
    "ignored_modules": "FSDP2 has no ignored modules: every parameter of a fully_shard'ed module is sharded",
    "ignored_states": "FSDP2 has no ignored states: every parameter of a fully_shard'ed module is sharded",
    "auto_wrap_policy_kwargs": "unknown FSDP1 argument",
}


@dataclass
class Problem:
    code: str  # the refusal's code in fsdp2_retrofit.rewrite.refusals
    node: cst.CSTNode
    what: str
    why: str
    hint: str = ""


@dataclass
class Fsdp1Wrap:
    """`target = FullyShardedDataParallel(wrapped, ...)`."""

    call: cst.Call
    stmt: cst.SimpleStatementLine
    target: str
    wrapped: cst.BaseExpression
    policy: str = "none"  # "none" | "transformer" | "module" | "lambda" | "size"
    classes: Tuple[str, ...] = ()  # the classes a policy wraps (code of each class expression)
    strategy: str = "FULL_SHARD"
    param_dtype: Optional[str] = None  # "bfloat16" | "float16" | "float32" | None
    reduce_dtype: Optional[str] = None
    buffer_dtype: Optional[str] = None
    offload: bool = False
    dropped: List[Tuple[str, str]] = field(default_factory=list)  # (keyword, reason)
    consumed: List[cst.CSTNode] = field(default_factory=list)  # statements that only define its arguments
    settings_node: Dict[str, cst.CSTNode] = field(default_factory=dict)  # keyword -> its argument


@dataclass
class StateDictBlock:
    """`with FSDP.state_dict_type(model, StateDictType.X, [config]): ...`."""

    node: cst.With
    model: str
    kind: str  # "FULL_STATE_DICT" | "SHARDED_STATE_DICT" | ...
    cpu_offload: bool = False
    consumed: List[cst.CSTNode] = field(default_factory=list)  # `config = FullStateDictConfig(...)`


@dataclass
class Fsdp1Uses:
    wraps: List[Fsdp1Wrap]
    blocks: List[StateDictBlock]
    scalers: List[cst.Call]
    clips: List[cst.Call]  # `model.clip_grad_norm_(...)` of a wrapped model
    # `sd = model.state_dict()` of a wrapped model outside state_dict_type: FSDP1's default
    # FULL_STATE_DICT, the full state dict on every rank
    default_state_dicts: List[cst.Call]
    module_attrs: List[cst.Attribute]  # `model.module`: the module FSDP1 wrapped
    imports: List[cst.CSTNode]  # import statements that import FSDP1 names
    problems: List[Problem]
    # values read by value into a wrap's settings (a config's field, a policy of a helper): they stay as written
    read_values: List[cst.CSTNode] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.wraps or self.blocks or self.scalers or self.problems)


def is_fsdp1_name(qname: str) -> bool:
    if qname in FSDP1_CLASSES or qname in SCALER:
        return True
    if qname.startswith(tuple(f"{c}." for c in FSDP1_CLASSES)):
        return True
    if qname.startswith(FSDP1_MODULES):
        return True
    head, _, last = qname.rpartition(".")
    return head == "torch.distributed.fsdp" and last in FSDP1_NAMES


def _qnames(node, facts: ScriptFacts) -> Set[str]:
    return facts.resolver.qnames(node)


def fsdp1_uses(facts: ScriptFacts) -> Fsdp1Uses:
    """Every FSDP1 use of the script (empty when it has none)."""
    finder = _Finder(facts)
    return finder.run()


class _Finder(ValueReader):
    def __init__(self, facts: ScriptFacts):
        super().__init__(facts)
        self.problems: List[Problem] = []

    def run(self) -> Fsdp1Uses:
        calls = self.r.nodes(cst.Call)
        wraps = [self._wrap(c) for c in calls if _qnames(c, self.facts) & FSDP1_CLASSES]
        wraps = [w for w in wraps if w is not None]
        targets = {w.target for w in wraps}
        blocks = [b for b in (self._block(w) for w in self.r.nodes(cst.With)) if b is not None]
        scalers = [c for c in calls if _qnames(c, self.facts) & SCALER]
        clips = [c for c in calls if self._fsdp1_clip(c, targets)]
        for c in calls:
            if isinstance(c.func, cst.Attribute) and _named_module(c.func.value) and code(c.func.value) in targets:
                method = c.func.attr.value
                if method == "no_sync":
                    self.problems.append(Problem(
                        "FSR306",
                        c, f"`{code(c)}` (FSDP1 gradient accumulation without reduction)",
                        "FSDP2 modules have no no_sync(); the rewrite does not restructure this loop yet",
                        f"call {code(c.func.value)}.set_requires_gradient_sync(False) on the micro-batches "
                        "that must not reduce (or remove no_sync and let the rewrite's accumulation stage do it)",
                    ))
            names = _qnames(c, self.facts)
            if any(n.endswith(".summon_full_params") and is_fsdp1_name(n) for n in names):
                self.problems.append(Problem(
                    "FSR306",
                    c, "FSDP.summon_full_params(...) is not converted",
                    "FSDP2 has no summon_full_params: parameters are DTensors and stay sharded",
                    "read a parameter whole with `param.full_tensor()` (a collective, on every rank), or the "
                    "whole model with get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))",
                ))
            if any(n.endswith(".set_state_dict_type") and is_fsdp1_name(n) for n in names):
                self.problems.append(Problem(
                    "FSR305",
                    c, "FSDP.set_state_dict_type(...) changes what every later state_dict() returns",
                    "the rewrite converts state dicts taken inside `with FSDP.state_dict_type(...)` only",
                    "take the state dicts inside `with FSDP.state_dict_type(model, ...):`",
                ))
        imports = [
            s for s in self.r.nodes(cst.SimpleStatementLine)
            if any(isinstance(b, cst.ImportFrom) and _imports_fsdp1(b) for b in s.body)
        ]
        in_blocks = {id(b.node.body) for b in blocks}
        default_state_dicts = [
            c for c in calls
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == "state_dict" and not c.args
            and _wrapped_name(c.func.value) in targets
            and not any(id(a) in in_blocks for a in self.r.ancestors(c))
            and _is_assigned_value(c, self.r)
        ]
        module_attrs = [
            a for a in self.r.nodes(cst.Attribute)
            if a.attr.value == "module" and _named_module(a.value) and code(a.value) in targets
        ]
        return Fsdp1Uses(wraps, blocks, scalers, clips, default_state_dicts, module_attrs, imports, self.problems,
                         self.read_values)

    def _fsdp1_clip(self, call: cst.Call, targets: Set[str]) -> bool:
        """`model.clip_grad_norm_(max_norm[, norm_type])`: FSDP1's method, of a wrapped model named
        as wrapped, or of a module the program hands on (`self.model`, a parameter `model` of a
        loop helper) where the program wraps with FSDP1: an nn.Module has no such method, and
        the torch function (or another library's, `accelerator.clip_grad_norm_(params, ...)`)
        takes the parameters first."""
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "clip_grad_norm_"):
            return False
        if _named_module(func.value) and code(func.value) in targets:
            return True
        if not targets or self.r.qnames(func) or not isinstance(func.value, (cst.Name, cst.Attribute)):
            return False  # a name bound by an import (torch.nn.utils...), or no FSDP1 wrap in the program
        positional = [a for a in call.args if a.keyword is None]
        first = positional[0].value if positional else None
        params = isinstance(first, cst.Call) and isinstance(first.func, cst.Attribute) and first.func.attr.value in (
            "parameters", "named_parameters")
        return len(positional) <= 2 and not params and not any(a.star for a in call.args)

    # -- FullyShardedDataParallel(...) ------------------------------------------------

    def _wrap(self, call: cst.Call) -> Optional[Fsdp1Wrap]:
        stmt = self.r.statement_of(call)
        small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
        if not (
            isinstance(small, cst.Assign) and small.value is call and len(small.targets) == 1
            and _named_module(small.targets[0].target)
        ):
            self.problems.append(Problem(
                "FSR301",
                call, "FullyShardedDataParallel(...) is not the whole value of `model = FSDP(...)` or "
                "`self.model = FSDP(...)`",
                "the rewrite replaces the wrap statement by fully_shard calls on the model it names",
                "write `model = FSDP(model, ...)` on its own line",
            ))
            return None
        wrapped = keyword_arg(call, "module", 0)
        if wrapped is None:
            self.problems.append(Problem("FSR301", call, "FullyShardedDataParallel(...) without a module", "nothing to shard"))
            return None
        wrap = Fsdp1Wrap(call, stmt, code(small.targets[0].target), wrapped)
        positional = [a for a in call.args if a.keyword is None]
        if len(positional) > 1 or any(a.star for a in call.args):
            self.problems.append(Problem(
                "FSR301",
                call, "FullyShardedDataParallel(...) with positional or unpacked arguments after the module",
                "the rewrite reads FSDP1's settings by keyword", "pass them by keyword",
            ))
            return wrap
        for arg in call.args[1:]:
            key = arg.keyword.value
            value = arg.value
            wrap.settings_node[key] = value
            if key == "auto_wrap_policy":
                self._policy(wrap, value)
            elif key == "sharding_strategy":
                self._strategy(wrap, value)
            elif key == "mixed_precision":
                self._mixed_precision(wrap, value)
            elif key == "cpu_offload":
                self._offload(wrap, value)
            elif key in DROPPED:
                wrap.dropped.append((key, DROPPED[key]))
            else:
                why = REFUSED.get(key, "the rewrite does not know how FSDP2 does this")
                self.problems.append(Problem("FSR302", arg, f"FullyShardedDataParallel(..., {key}=...)", why,
                                             "remove the argument, or migrate this part by hand"))
        return wrap

    def _refuse(self, code, node, what, why, hint=""):
        self.problems.append(Problem(code, node, what, why, hint))

    def _policy(self, wrap: Fsdp1Wrap, expr) -> None:
        value = self._resolve(expr, wrap)
        kind, classes = None, ()
        if isinstance(value, cst.Call) and self._qn(value) & {"functools.partial"} and value.args:
            fn = value.args[0].value
            kind = self._policy_kind(fn)
            if kind == "transformer":
                classes = self._class_set(keyword_arg(value, "transformer_layer_cls"), wrap)
            elif kind == "lambda":
                classes = self._lambda_classes(keyword_arg(value, "lambda_fn"), wrap)
            elif kind == "size":
                classes = ()
        elif isinstance(value, cst.Call) and self._policy_kind(value.func) == "module":
            kind = "module"
            classes = self._class_set(keyword_arg(value, "module_classes", 0), wrap)
        elif isinstance(value, cst.Lambda):
            kind = "lambda"
            classes = self._lambda_classes(value, wrap)
        elif self._policy_kind(value) == "size":
            kind = "size"
        if kind is None or (kind in ("transformer", "module", "lambda") and not classes):
            self._refuse(
                "FSR303",
                expr, f"auto_wrap_policy={code(expr)} is not a policy the rewrite reads",
                self._lost.get(id(expr), "it reads transformer_auto_wrap_policy / lambda_auto_wrap_policy "
                               "(functools.partial), ModuleWrapPolicy({Block}), size_based_auto_wrap_policy, "
                               "or a lambda testing isinstance"),
                "name the wrapped classes: `rewrite --shard Block` after removing the FSDP(...) wrap",
            )
            return
        wrap.policy, wrap.classes = kind, classes

    def _policy_kind(self, fn) -> Optional[str]:
        for q in self._qn(fn):
            last = q.rsplit(".", 1)[-1]
            if last in POLICIES and q.startswith("torch.distributed.fsdp"):
                return POLICIES[last]
        return None

    def _class_set(self, expr, wrap: Fsdp1Wrap) -> Tuple[str, ...]:
        if expr is None:
            return ()
        value = self._resolve(expr, wrap)
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value in ("set", "frozenset", "tuple", "list") and len(value.args) == 1:
            value = value.args[0].value
        if isinstance(value, (cst.Set, cst.List, cst.Tuple)):
            out = []
            for e in value.elements:
                if not isinstance(e, cst.Element) or not isinstance(e.value, (cst.Name, cst.Attribute)):
                    return ()
                out.append(code(e.value))
            return tuple(out)
        if isinstance(value, (cst.Name, cst.Attribute)):
            return (code(value),)
        return ()

    def _lambda_classes(self, expr, wrap: Fsdp1Wrap) -> Tuple[str, ...]:
        """The classes of `lambda m[, ...]: isinstance(m, (A, B))` (or `... or isinstance(m, C)`)."""
        value = self._resolve(expr, wrap) if expr is not None else None
        if not isinstance(value, cst.Lambda) or not value.params.params:
            return ()
        module = value.params.params[0].name.value
        # a bare policy function (module, recurse, nonwrapped_numel) must say `recurse or ...`
        recurse = value.params.params[1].name.value if len(value.params.params) > 1 else None
        out: List[str] = []

        def collect(e) -> bool:
            if isinstance(e, cst.BooleanOperation) and isinstance(e.operator, cst.Or):
                return collect(e.left) and collect(e.right)
            if isinstance(e, cst.Name) and e.value == recurse:
                return True
            if (
                isinstance(e, cst.Call) and isinstance(e.func, cst.Name) and e.func.value == "isinstance"
                and len(e.args) == 2 and isinstance(e.args[0].value, cst.Name) and e.args[0].value.value == module
            ):
                found = self._class_set(e.args[1].value, wrap)
                out.extend(found)
                return bool(found)
            return False

        return tuple(out) if collect(value.body) else ()

    def _enum_member(self, expr, enum: str) -> Optional[str]:
        for q in self._qn(expr):
            head, _, last = q.rpartition(".")
            if head.endswith(f".{enum}") and is_fsdp1_name(head):
                return last
        return None

    def _strategy(self, wrap: Fsdp1Wrap, expr) -> None:
        member = self._enum_member(self._resolve(expr, wrap), "ShardingStrategy")
        if member is None:
            self._refuse("FSR303", self.lost_at.get(id(expr), expr),
                         f"sharding_strategy={code(expr)} is not a ShardingStrategy member the rewrite can read",
                         self._lost.get(id(expr), "the rewrite maps each member to its FSDP2 setting"),
                         "write ShardingStrategy.FULL_SHARD (or another member)")
            return
        wrap.strategy = member  # NO_SHARD too: a (world, 1) mesh (migrate_fsdp1)

    def _mixed_precision(self, wrap: Fsdp1Wrap, expr) -> None:
        value = self._resolve(expr, wrap)
        if isinstance(value, cst.Name) and value.value == "None":
            return
        if not (isinstance(value, cst.Call) and any(q.endswith(".MixedPrecision") and is_fsdp1_name(q) for q in self._qn(value))):
            self._refuse("FSR303", expr, f"mixed_precision={code(expr)} is not a MixedPrecision(...) the rewrite can read",
                         self._lost.get(id(expr), "its dtypes become the MixedPrecisionPolicy"),
                         "write MixedPrecision(param_dtype=..., ...) in the call or one assignment")
            return
        for arg in value.args:
            key = arg.keyword.value if arg.keyword else None
            if key in ("param_dtype", "reduce_dtype", "buffer_dtype"):
                dtype = self._dtype(arg.value)
                if dtype is None:
                    self._refuse("FSR303", arg, f"MixedPrecision({key}={code(arg.value)})", "the dtype is not one the rewrite knows",
                                 "write torch.bfloat16, torch.float16 or torch.float32")
                    return
                setattr(wrap, key, None if dtype == "None" else dtype)
            elif key in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs", "_module_classes_to_ignore"):
                wrap.dropped.append((f"MixedPrecision({key}=...)", "FSDP2 casts the root's forward inputs to param_dtype "
                                     "(MixedPrecisionPolicy.cast_forward_inputs, on by default) and keeps gradients "
                                     "in the reduce dtype"))
            else:
                self._refuse("FSR303", arg, "MixedPrecision(...) with an argument the rewrite does not read", "",
                             "pass param_dtype/reduce_dtype/buffer_dtype by keyword")
                return

    def _dtype(self, expr) -> Optional[str]:
        if isinstance(expr, cst.Name) and expr.value == "None":
            return "None"
        for q in self._qn(expr) | {code(expr)}:
            if q in DTYPES:
                return DTYPES[q]
        return None

    def _offload(self, wrap: Fsdp1Wrap, expr) -> None:
        value = self._resolve(expr, wrap)
        if isinstance(value, cst.Name) and value.value == "None":
            return
        if not (isinstance(value, cst.Call) and any(q.endswith(".CPUOffload") and is_fsdp1_name(q) for q in self._qn(value))):
            self._refuse("FSR303", expr, f"cpu_offload={code(expr)} is not a CPUOffload(...) the rewrite can read", "",
                         "write CPUOffload(offload_params=True) in the call or one assignment")
            return
        flag = keyword_arg(value, "offload_params", 0)
        if flag is None or (isinstance(flag, cst.Name) and flag.value == "False"):
            wrap.dropped.append(("cpu_offload", "CPUOffload(offload_params=False) offloads nothing"))
        elif isinstance(flag, cst.Name) and flag.value == "True":
            wrap.offload = True
        else:
            self._refuse("FSR303", flag, f"CPUOffload(offload_params={code(flag)})", "the value must be known when rewriting",
                         "write True or False")

    # -- with FSDP.state_dict_type(...) ---------------------------------------------

    def _block(self, node: cst.With) -> Optional[StateDictBlock]:
        calls = [
            item.item for item in node.items
            if isinstance(item.item, cst.Call)
            and any(q.endswith(".state_dict_type") and is_fsdp1_name(q) for q in _qnames(item.item, self.facts))
        ]
        if not calls:
            return None
        call = calls[0]
        if len(node.items) != 1 or node.items[0].asname is not None:
            self._refuse("FSR305", node, "`with FSDP.state_dict_type(...)` together with other context managers", "",
                         "give it a `with` statement of its own")
            return None
        model = keyword_arg(call, "module", 0)
        kind = self._enum_member(keyword_arg(call, "state_dict_type", 1), "StateDictType") if keyword_arg(call, "state_dict_type", 1) is not None else None
        if not _named_module(model) or kind not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            self._refuse(
                "FSR305",
                call, f"`{code(call)}` is not converted",
                "the rewrite converts FULL_STATE_DICT and SHARDED_STATE_DICT of a model named by a variable "
                "(or `self.model`) "
                "(LOCAL_STATE_DICT has no FSDP2 counterpart)",
                "use StateDictType.FULL_STATE_DICT or SHARDED_STATE_DICT",
            )
            return None
        block = StateDictBlock(node, code(model), kind)
        config = keyword_arg(call, "state_dict_config", 2)
        if config is not None:
            config = self._resolve(config, block)
        if config is not None and kind == "FULL_STATE_DICT":
            if not isinstance(config, cst.Call):
                self._refuse("FSR305", config, f"state_dict_config={code(config)}", "its settings must be readable", "write FullStateDictConfig(...) in the call")
                return None
            for key in ("offload_to_cpu", "rank0_only"):
                flag = keyword_arg(config, key)
                if isinstance(flag, cst.Name) and flag.value == "True":
                    block.cpu_offload = True
        return block


def _named_module(expr) -> bool:
    """`model` or `self.model`: a module named by a variable or an attribute of one."""
    if isinstance(expr, cst.Attribute):
        return isinstance(expr.value, cst.Name) and expr.value.value == "self"
    return isinstance(expr, cst.Name)


def wrapped_name(expr) -> Optional[str]:
    """`model` for `model` and `model.module` (the module FSDP1 wraps), `self.model` for
    `self.model` and `self.model.module`."""
    if isinstance(expr, cst.Attribute) and expr.attr.value == "module" and _named_module(expr.value):
        expr = expr.value
    return code(expr) if _named_module(expr) else None


_wrapped_name = wrapped_name


def _is_assigned_value(call: cst.Call, r) -> bool:
    """`name = call` as a statement of its own."""
    stmt = r.statement_of(call)
    return (
        isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)
        and stmt.body[0].value is call and len(stmt.body[0].targets) == 1
        and isinstance(stmt.body[0].targets[0].target, cst.Name)
    )


def _imports_fsdp1(node: cst.ImportFrom) -> bool:
    if node.module is None or isinstance(node.names, cst.ImportStar):
        return False
    module = code(node.module)
    return any(is_fsdp1_name(f"{module}.{code(a.name)}") for a in node.names)


def fsdp1_alias_names(node: cst.ImportFrom) -> List[str]:
    """The names an `from ... import` binds to FSDP1 API."""
    module = code(node.module)
    return [code(a.name) for a in node.names if is_fsdp1_name(f"{module}.{code(a.name)}")]


def leftover(facts: ScriptFacts, handled: Set[int]) -> Optional[cst.CSTNode]:
    """The first use of the FSDP1 API outside the handled nodes (ids) and imports."""
    r = facts.resolver
    for node in r.nodes(cst.Name) + r.nodes(cst.Attribute):
        if not any(is_fsdp1_name(q) for q in r.qnames(node)):
            continue
        chain = [node] + list(r.ancestors(node))
        if any(isinstance(a, (cst.Import, cst.ImportFrom)) for a in chain):
            continue
        if any(id(a) in handled for a in chain):
            continue
        return node
    return None
