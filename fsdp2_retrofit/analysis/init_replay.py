"""What `--meta-init` must redo after `to_empty`: the model's whole initialisation.

A model built under `torch.device("meta")` has parameters and buffers without
storage; `to_empty` gives them memory but no values. This module reads the
`__init__` of the model's class and of every class it builds (the script's or a
sibling module's, parsed, never imported) and answers with the statements that
re-create, on the sharded model, what construction did:

- every module's own `reset_parameters()` (one generic loop; torch.nn classes
  are accepted only where that call re-creates all of their state);
- the class's own initialisation, replayed with `self` replaced by the instance:
  `self.apply(self._init_weights)`, `nn.init.*(self.x...)`, loops over
  `self.named_parameters()`; methods and module functions they call must only
  compute (no attribute stores, no module construction);
- `nn.Parameter(torch.zeros/ones/randn/rand/full(...))` as the matching
  `nn.init` call on the (sharded) parameter;
- buffers (`self.register_buffer(name, expr)`) and plain tensor attributes,
  re-computed from the constructor's arguments, constants and `torch`/`math`;
- tied weights need nothing: the tie is one Parameter object, and fully_shard
  and to_empty keep it one object.

Anything it cannot re-create safely raises `CannotReplay`, which the stage turns
into a refusal: a model with garbage memory in it must never be emitted.
"""
from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

import libcst as cst

from .model_classes import ClassInfo, ClassRegistry
from fsdp2_retrofit.syntax.names import CONTAINERS, Resolver, attr_path, bind_args, code, import_bindings
from fsdp2_retrofit.syntax.torch_api import NN_PARAMETER as PARAMETER, TORCH_MODULE_BASES

# torch.nn classes whose reset_parameters() re-creates every parameter and buffer
# they own (or which own none).
RESET_COMPLETE = {
    "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
    "ConvTranspose3d", "Embedding", "EmbeddingBag", "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d",
    "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LSTM", "GRU", "RNN",
    "LSTMCell", "GRUCell", "RNNCell", "PReLU",
}
STATELESS = {
    "ReLU", "ReLU6", "GELU", "SiLU", "Mish", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "LeakyReLU", "ELU",
    "SELU", "CELU", "Hardswish", "Hardsigmoid", "Hardtanh", "Softplus", "Softsign", "Dropout", "Dropout1d",
    "Dropout2d", "Dropout3d", "AlphaDropout", "Identity", "Flatten", "Unflatten", "MaxPool1d", "MaxPool2d",
    "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "Upsample",
    "PixelShuffle", "PixelUnshuffle", "ZeroPad1d", "ZeroPad2d", "ConstantPad1d", "ConstantPad2d",
    "ReflectionPad1d", "ReflectionPad2d", "Module", "ModuleList", "Sequential", "ModuleDict",
}
SAFE_BUILTINS = {
    "range", "len", "int", "float", "bool", "str", "min", "max", "abs", "round", "sum", "pow", "divmod",
    "isinstance", "issubclass", "getattr", "hasattr", "callable", "tuple", "list", "dict", "zip", "enumerate",
    "reversed", "sorted", "any", "all", "True", "False", "None", "type", "print", "ValueError",
    "NotImplementedError", "AssertionError", "super",
}
# torch functions that read data from outside the program: never re-run
TORCH_DATA = ("torch.load", "torch.from_numpy", "torch.frombuffer", "torch.from_file", "torch.hub.", "torch.utils.")
MODULE_METHODS = {
    "parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children",
    "named_children", "apply", "get_submodule", "get_parameter", "get_buffer",
}
# nn.Parameter(<factory>(...)) -> the nn.init call that draws the same distribution
PARAM_FACTORIES = {
    "torch.zeros": "zeros_", "torch.ones": "ones_", "torch.randn": "normal_", "torch.rand": "uniform_",
    "torch.empty": None,
}


class CannotReplay(Exception):
    """The initialisation cannot be re-created after to_empty; `node` is in `info`'s file."""

    def __init__(self, node: Optional[cst.CSTNode], info: Optional[ClassInfo], what: str, why: str, hint: str = ""):
        super().__init__(what)
        self.node, self.info, self.what, self.why, self.hint = node, info, what, why, hint


@dataclass
class InitReplay:
    """Statements to run under torch.no_grad() after to_empty, in order, and the
    imports (module, name, alias) they need in the script."""

    statements: List[str] = field(default_factory=list)
    imports: List[Tuple[str, Optional[str], Optional[str]]] = field(default_factory=list)


@dataclass
class _Ctx:
    """One class's __init__ being replayed on an instance."""

    info: ClassInfo
    instance: str  # the code that names the instance in the script: "model", "module"
    env: Dict[str, Optional[cst.BaseExpression]]  # constructor parameter -> its value in the script
    locals: Dict[str, Optional[cst.BaseExpression]] = field(default_factory=dict)

    @property
    def resolver(self) -> Resolver:
        return self.info.namer.resolver


def plan_init_replay(
    classes: ClassRegistry,
    root: str,
    build_call: cst.Call,
    script: Resolver,
    model_name: str,
    fresh: Callable[[str], str],
) -> InitReplay:
    """The re-initialisation of `model_name = <build_call>` (a call of class `root`)."""
    return _Planner(classes, script, model_name, fresh).run(root, build_call)


class _Planner:
    """Walks the model's class tree and replays each class's __init__ statement by
    statement; the expressions they keep become script code through _Translator."""

    def __init__(self, classes: ClassRegistry, script: Resolver, model: str, fresh):
        self.classes = classes
        self.script = script
        self.model = model
        self.fresh = fresh
        self.out = InitReplay()
        self.translator = _Translator(classes, script, self.out.imports)
        self.visited: Set[str] = set()
        self.instance_var: Optional[str] = None

    # -- the class tree --------------------------------------------------------

    def run(self, root: str, build_call: cst.Call) -> InitReplay:
        m = self._instance_var()
        self.out.statements.append(
            f"for {m} in {self.model}.modules():\n"
            f"    if callable(getattr({m}, \"reset_parameters\", None)):\n"
            f"        {m}.reset_parameters()\n"
        )
        info = self.classes.get(root)
        if info is None:
            if not _torch_nn(root):
                raise CannotReplay(
                    build_call, None, f"the model's class `{root}` is not defined in the script or beside it",
                    "its initialisation cannot be read, so it cannot be re-run after to_empty",
                )
            self._check_torch_class(root, build_call, None)
            for call, child in self._children_in(build_call, self.script, None):
                self._visit(child, self._child_env(child, call, None), call)
        else:
            env = self._root_env(info, build_call)
            self._visit(info.name, env, build_call, root=True)
        return self.out

    def _visit(self, name: str, env, site: cst.CSTNode, root: bool = False, parent: Optional[ClassInfo] = None):
        info = self.classes.get(name)
        if info is None:
            self._check_torch_class(name, site, parent)
            return
        if name in self.visited and not root:
            return
        self.visited.add(name)
        init = self._init_of(info, site, parent)
        if "reset_parameters" in info.methods:  # the generic loop calls it after sharding
            ctx = _Ctx(info, self._instance_var(), {})
            self.translator.check_pure(info.methods["reset_parameters"], ctx, 2)
        if init is None:
            return
        instance = self.model if root else self._instance_var()
        ctx = _Ctx(info, instance, dict(env))
        self._stored_params(ctx, init)
        for call, child in self._children_in(init.body, ctx.resolver, info):
            self._visit(child, self._child_env(child, call, ctx), call, parent=info)
        body = self._replay_block(list(init.body.body), ctx)
        if not body:
            return
        text = "".join(_render(s) for s in body)
        if root:
            self.out.statements.append(text)
        else:
            self.out.statements.append(
                f"for {instance} in {self.model}.modules():\n"
                f"    if isinstance({instance}, {self.translator.script_name(info)}):\n"
                + _indent(text, 8)
            )

    def _init_of(self, info: ClassInfo, site, parent) -> Optional[cst.FunctionDef]:
        init = info.methods.get("__init__")
        for base in info.bases:
            if base in TORCH_MODULE_BASES:
                continue
            if self.classes.get(base) is not None:
                if init is None:
                    return self._init_of(self.classes.get(base), site, parent)
                raise CannotReplay(
                    init, info, f"{info.name} extends {base} and has its own __init__",
                    "following constructor arguments through super().__init__ is not supported by --meta-init",
                    "drop --meta-init for this script",
                )
            self._check_torch_class(base, site, parent)
        return init

    def _check_torch_class(self, name: str, site, parent: Optional[ClassInfo]) -> None:
        short = name.rsplit(".", 1)[-1]
        if _torch_nn(name) and (short in RESET_COMPLETE or short in STATELESS):
            return
        why = (
            "its reset_parameters() does not re-create all of its parameters and buffers"
            if _torch_nn(name)
            else "its initialisation is not in the script or beside it, so it cannot be re-run after to_empty"
        )
        raise CannotReplay(site, parent, f"the model builds `{name}`", why, "drop --meta-init for this script")

    def _children_in(self, node, resolver: Resolver, info: Optional[ClassInfo]):
        """(call, class) for each module constructor call inside `node`."""
        found = []

        class _C(cst.CSTVisitor):
            def visit_Call(self_, call: cst.Call) -> None:
                name = _global_name(call, resolver, info)
                if name and name not in PARAMETER and (self.classes.is_module_class(name) or name in CONTAINERS):
                    found.append((call, name))

        node.visit(_C())
        return found

    def _root_env(self, info: ClassInfo, call: cst.Call) -> Dict[str, Optional[cst.BaseExpression]]:
        init = info.methods.get("__init__")
        if init is None:
            return {}
        env: Dict[str, Optional[cst.BaseExpression]] = _defaults(init)
        for param, arg in bind_args(init, call, skip=1):
            env[param] = arg if _plain(arg) else None
        return env

    def _child_env(self, child: str, call: cst.Call, parent: Optional[_Ctx]):
        info = self.classes.get(child)
        init = info.methods.get("__init__") if info else None
        if init is None:
            return {}
        env = _defaults(init)
        for param, arg in bind_args(init, call, skip=1):
            if parent is None:
                env[param] = arg if _plain(arg) else None
                continue
            try:
                if "self" in _names(arg) and parent.instance != self.model:
                    raise CannotReplay(None, None, "", "")
                value = self.translator.translate(arg, parent, bound=set())
                env[param] = value if _plain(value) else None
            except CannotReplay:
                env[param] = None
        previous = getattr(self, "_envs", {}).get(child)
        if previous is not None:  # built at several places: keep what they agree on
            env = {k: v if previous.get(k) is not None and v is not None and code(v) == code(previous[k]) else None
                   for k, v in env.items()}
        self.__dict__.setdefault("_envs", {})[child] = env
        return env

    def _stored_params(self, ctx: _Ctx, init: cst.FunctionDef) -> None:
        """A parameter unknown from the call site, kept as `self.a = param`: read `instance.a`."""
        for stmt in init.body.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.value, cst.Name):
                    path = attr_path(small.targets[0].target)
                    param = small.value.value
                    if path and len(path) == 2 and path[0] == "self" and param in ctx.env and ctx.env[param] is None:
                        ctx.env[param] = cst.Attribute(cst.Name(ctx.instance), cst.Name(path[1]))

    def _instance_var(self) -> str:
        if self.instance_var is None:
            self.instance_var = self.fresh("module")
        return self.instance_var

    # -- statements ------------------------------------------------------------

    def _replay_block(self, stmts, ctx: _Ctx) -> List[cst.CSTNode]:
        out: List[cst.CSTNode] = []
        for stmt in stmts:
            if isinstance(stmt, cst.SimpleStatementLine):
                kept = [s for small in stmt.body for s in self._replay_small(small, stmt, ctx)]
                if kept:
                    out.append(cst.SimpleStatementLine(body=kept))
            elif isinstance(stmt, cst.If):
                out.extend(self._replay_if(stmt, ctx))
            elif isinstance(stmt, cst.For) and not self._constructs(stmt, ctx):
                if self._initialises(stmt, ctx):
                    out.append(self._translate_stmt(stmt, ctx))
                self._forget_locals(stmt, ctx)
            else:
                if self._initialises(stmt, ctx):
                    raise CannotReplay(
                        stmt, ctx.info, f"{ctx.info.name}.__init__ initialises inside a {type(stmt).__name__.lower()} block",
                        "--meta-init cannot re-run it safely after to_empty", "drop --meta-init for this script",
                    )
                self._forget_locals(stmt, ctx)
        return out

    def _replay_if(self, stmt: cst.If, ctx: _Ctx) -> List[cst.CSTNode]:
        body = self._replay_block(list(stmt.body.body), ctx) if isinstance(stmt.body, cst.IndentedBlock) else []
        orelse: List[cst.CSTNode] = []
        if isinstance(stmt.orelse, cst.Else):
            orelse = self._replay_block(list(stmt.orelse.body.body), ctx)
        elif isinstance(stmt.orelse, cst.If):
            orelse = self._replay_if(stmt.orelse, ctx)
        self._forget_locals(stmt, ctx)
        if not body and not orelse:
            return []
        test = self.translator.translate(stmt.test, ctx, bound=set())
        new = cst.If(
            test=test,
            body=cst.IndentedBlock(body=body or [cst.SimpleStatementLine([cst.Pass()])]),
            orelse=cst.Else(body=cst.IndentedBlock(body=orelse)) if orelse else None,
        )
        return [new]

    def _replay_small(self, small, stmt, ctx: _Ctx) -> List[cst.BaseSmallStatement]:
        if isinstance(small, (cst.Pass, cst.Assert, cst.Return)):
            return []
        if isinstance(small, cst.Expr):
            value = small.value
            if not isinstance(value, cst.Call):
                return []
            return self._replay_call_stmt(value, small, ctx)
        if isinstance(small, (cst.Assign, cst.AnnAssign)):
            targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
            return self._replay_assign(targets, small.value, small, ctx)
        if isinstance(small, cst.AugAssign):
            path = attr_path(small.target)
            if path and path[0] == "self":
                raise CannotReplay(small, ctx.info, f"`{code(small)}` in {ctx.info.name}.__init__",
                                   "--meta-init cannot tell what it re-creates", "drop --meta-init for this script")
            if isinstance(small.target, cst.Name):
                ctx.locals[small.target.value] = None
            return []
        return []

    def _replay_call_stmt(self, call: cst.Call, small, ctx: _Ctx) -> List[cst.BaseSmallStatement]:
        func = call.func
        path = attr_path(func) or ()
        if isinstance(func, cst.Attribute) and func.attr.value == "__init__":
            return []  # super().__init__(), nn.Module.__init__(self)
        if path[:1] == ("self",) and len(path) == 2:
            method = path[1]
            if method == "register_buffer":
                return self._replay_buffer(call, ctx)
            if method in ("register_parameter", "register_module", "add_module"):
                if method != "register_parameter" and self._children_in(call, ctx.resolver, ctx.info):
                    return []
                raise CannotReplay(call, ctx.info, f"`{code(call)}` in {ctx.info.name}.__init__",
                                   "--meta-init cannot re-create it after to_empty", "drop --meta-init for this script")
            if method == "reset_parameters":
                return []  # the generic reset_parameters() loop calls it
        if isinstance(func, cst.Attribute) and func.attr.value in ("append", "extend", "insert") and \
                self._children_in(call, ctx.resolver, ctx.info):
            return []  # self.layers.append(Block(...)): construction
        if self._children_in(call, ctx.resolver, ctx.info):
            return []
        if not self._initialises(call, ctx):
            return []  # print(...), logging: nothing to re-create
        self.translator.check_calls(call, ctx)
        return [small.with_changes(value=self.translator.translate(call, ctx, bound=set()))]

    def _replay_buffer(self, call: cst.Call, ctx: _Ctx) -> List[cst.BaseSmallStatement]:
        args = {a.keyword.value if a.keyword else i: a.value for i, a in enumerate(call.args)}
        name, value = args.get(0, args.get("name")), args.get(1, args.get("tensor"))
        if not isinstance(name, cst.SimpleString) or not str(name.evaluated_value).isidentifier():
            raise CannotReplay(call, ctx.info, f"a buffer with a computed name in {ctx.info.name}.__init__",
                               "--meta-init cannot tell which buffer to re-create", "drop --meta-init for this script")
        if value is None or (isinstance(value, cst.Name) and value.value == "None"):
            return []
        if isinstance(value, cst.IfExp) and "None" in {code(value.body), code(value.orelse)}:
            raise CannotReplay(
                call, ctx.info, f"buffer `{name.evaluated_value}` of {ctx.info.name} is `None` or a tensor",
                "--meta-init re-creates buffers that always exist",
                "register it under an `if` statement instead, or drop --meta-init for this script",
            )
        try:
            self.translator.check_calls(value, ctx)
            new = self.translator.translate(value, ctx, bound=set())
        except CannotReplay as err:
            raise CannotReplay(
                call, ctx.info, f"buffer `{name.evaluated_value}` of {ctx.info.name} cannot be re-computed ({err.what})",
                "after to_empty its memory holds garbage, and its value depends on something the analysis cannot "
                "re-run", "drop --meta-init for this script, or compute the buffer from constructor arguments",
            ) from None
        target = f"{ctx.instance}.{name.evaluated_value}"
        return [cst.Expr(cst.parse_expression(f"{target}.copy_({code(new)})"))]

    def _replay_assign(self, targets, value, small, ctx: _Ctx) -> List[cst.BaseSmallStatement]:
        if value is None:
            return []
        for target in targets:
            path = attr_path(target)
            if isinstance(target, cst.Name):
                ctx.locals[target.value] = None if (target.value in ctx.locals or self._children_in(
                    value, ctx.resolver, ctx.info)) else value
                continue
            if not path or path[0] != "self":
                for name in _names(target):
                    ctx.locals[name] = None
                continue
            vpath = attr_path(value)
            if vpath and vpath[0] == "self":
                continue  # a tie or an alias: the same object, kept by fully_shard and to_empty
            if self._children_in(value, ctx.resolver, ctx.info):
                continue  # a submodule: visited as a class of its own
            if len(path) > 2:
                raise CannotReplay(small, ctx.info, f"`{code(target)} = ...` in {ctx.info.name}.__init__",
                                   "--meta-init cannot re-create a value stored into a submodule",
                                   "drop --meta-init for this script")
            attr = path[1]
            if isinstance(value, cst.Call) and _global_name(value, ctx.resolver, ctx.info) in PARAMETER:
                replay = self._replay_parameter(attr, value, ctx)
                return [replay] if replay is not None else []
            calls = _calls(value)
            if not calls:
                continue  # a plain value (ints, the config): kept by the meta build
            self.translator.check_calls(value, ctx, what=f"`self.{attr}`")
            if any(_is_torch(_global_name(c, ctx.resolver, ctx.info)) for c in calls):
                new = self.translator.translate(value, ctx, bound=set())
                return [cst.parse_statement(f"{ctx.instance}.{attr} = {code(new)}\n").body[0]]
        return []

    def _replay_parameter(self, attr: str, call: cst.Call, ctx: _Ctx) -> Optional[cst.BaseSmallStatement]:
        data = call.args[0].value if call.args and call.args[0].keyword is None else None
        scale = None
        if isinstance(data, cst.BinaryOperation) and isinstance(data.operator, cst.Multiply):
            for factory, other in ((data.left, data.right), (data.right, data.left)):
                if isinstance(factory, cst.Call) and _global_name(factory, ctx.resolver, ctx.info) == "torch.randn":
                    data, scale = factory, other
        factory = _global_name(data, ctx.resolver, ctx.info) if isinstance(data, cst.Call) else None
        target = f"{ctx.instance}.{attr}"
        if factory in PARAM_FACTORIES:
            init = PARAM_FACTORIES[factory]
            if init is None:  # torch.empty: what follows in __init__ fills it
                return None
            self.out.imports.append(("torch", None, None))
            extra = ""
            if scale is not None:
                self.translator.check_calls(scale, ctx)
                extra = f", std={code(self.translator.translate(scale, ctx, bound=set()))}"
            return cst.Expr(cst.parse_expression(f"torch.nn.init.{init}({target}{extra})"))
        if factory == "torch.full" and isinstance(data, cst.Call) and len(data.args) >= 2:
            self.translator.check_calls(data.args[1].value, ctx)
            fill = code(self.translator.translate(data.args[1].value, ctx, bound=set()))
            self.out.imports.append(("torch", None, None))
            return cst.Expr(cst.parse_expression(f"torch.nn.init.constant_({target}, {fill})"))
        raise CannotReplay(
            call, ctx.info, f"parameter `self.{attr}` of {ctx.info.name} is `{code(call)}`",
            "--meta-init re-creates parameters only from torch.zeros/ones/randn/rand/full/empty "
            "(the sharded parameter cannot be assigned a full tensor)",
            "drop --meta-init for this script, or create it with torch.empty and initialise it with nn.init",
        )

    # -- what a statement does -------------------------------------------------

    def _constructs(self, stmt, ctx: _Ctx) -> bool:
        """A loop that builds submodules (`self.layers.append(Block(...))`)."""
        if not self._children_in(stmt, ctx.resolver, ctx.info):
            return False
        if self._initialises(stmt, ctx):
            raise CannotReplay(
                stmt, ctx.info, f"{ctx.info.name}.__init__ builds and initialises modules in one loop",
                "--meta-init cannot re-run the initialisation without re-building", "drop --meta-init for this script",
            )
        return True

    def _initialises(self, node, ctx: _Ctx) -> bool:
        """Whether `node` writes values: nn.init, in-place tensor methods, buffers, parameters,
        apply, stores into attributes (`p.data = ...`)."""
        if any(attr_path(t.target) and len(attr_path(t.target)) > 1 for t in _walk(node, (cst.AssignTarget,))):
            return True
        for call in _calls(node):
            name = _global_name(call, ctx.resolver, ctx.info) or ""
            attr = call.func.attr.value if isinstance(call.func, cst.Attribute) else ""
            path = attr_path(call.func) or ()
            if name.startswith("torch.nn.init.") or name in PARAMETER:
                return True
            if len(path) == 2 and path[0] == "self" and path[1] != "__init__" and (
                path[1] not in MODULE_METHODS or path[1] == "apply"
            ):
                return True  # self.init_weights(): the class's own initialisation
            if any("self" in _names(a.value) for a in call.args):
                return True  # my_init(self.fc.weight): it may write what it is given
            if attr in ("register_buffer", "register_parameter", "apply", "copy_") or (
                attr.endswith("_") and not attr.startswith("_")
            ):
                return True
        return False

    def _forget_locals(self, stmt, ctx: _Ctx) -> None:
        class _T(cst.CSTVisitor):
            def visit_AssignTarget(self_, node: cst.AssignTarget) -> None:
                for n in _names(node.target):
                    ctx.locals[n] = None

            def visit_For(self_, node: cst.For) -> None:
                for n in _names(node.target):
                    ctx.locals[n] = None

        stmt.visit(_T())

    def _translate_stmt(self, stmt, ctx: _Ctx) -> cst.CSTNode:
        for target in _walk(stmt, (cst.AssignTarget,)):
            if attr_path(target.target) and len(attr_path(target.target)) > 1:
                raise CannotReplay(
                    target, ctx.info, f"`{code(target.target)} = ...` in {ctx.info.name}.__init__",
                    "after fully_shard parameters are DTensor shards: storing a whole tensor into them is wrong",
                    "initialise with torch.nn.init functions or in-place methods (normal_, zero_), or drop --meta-init",
                )
        self.translator.check_calls(stmt, ctx)
        bound = _bound_in(stmt)
        renames = {n: self.fresh(n) for n in bound}
        return self.translator.translate(stmt, ctx, bound=bound, renames=renames)


class _Translator:
    """The class file's code as code of the script that re-runs it: `self` -> the instance,
    constructor parameters -> their values at the call, locals of __init__ inlined, free
    names imported into the script (`imports`, shared with the plan); and whether what it
    calls only computes, so that running it again changes values, never the structure."""

    def __init__(self, classes: ClassRegistry, script: Resolver, imports: list):
        self.classes = classes
        self.imports = imports
        self.script_bindings = _top_level_bindings(script)

    def script_name(self, info: ClassInfo) -> str:
        """How the script names a class: its own, or imported from the sibling module."""
        short = info.name.rsplit(".", 1)[-1]
        if not info.namespace:
            return short
        self._need_binding(short, f"{info.namespace}.{short}", info.node, info)
        return short

    def check_calls(self, node, ctx: _Ctx, what: str = "", depth: int = 2) -> None:
        """Every call in `node` only computes: torch (not its data loaders), math,
        builtins, methods of values, and the class's own pure methods and functions."""
        for call in _calls(node):
            self._check_call(call, ctx, depth)

    def _check_call(self, call: cst.Call, ctx: _Ctx, depth: int) -> None:
        func = call.func
        path = attr_path(func)
        if path and path[0] == "self":
            if len(path) > 2:
                return  # a method of a submodule or a tensor attribute: self.head.weight.normal_()
            method = path[1]
            if method == "apply":
                for arg in call.args:
                    self._check_callable(arg.value, ctx, depth)
                return
            if method in MODULE_METHODS:
                return
            if method in ctx.info.methods:
                self.check_pure(ctx.info.methods[method], ctx, depth)
                return
            raise CannotReplay(call, ctx.info, f"`{code(call)}`", "the analysis cannot tell what it does")
        if isinstance(func, cst.Name) and (func.value in ctx.locals or func.value in ctx.env):
            raise CannotReplay(call, ctx.info, f"`{code(call)}` calls a value", "the analysis cannot tell what it does")
        name = _global_name(call, ctx.resolver, ctx.info)
        if name:
            if _safe_name(name):
                return
            fn = _top_function(ctx.resolver, name) if isinstance(func, cst.Name) else None
            if fn is not None:
                self.check_pure(fn, ctx, depth)
                return
            raise CannotReplay(call, ctx.info, f"`{code(call)}`",
                               "it is not a torch or math computation the analysis can re-run")
        if isinstance(func, cst.Attribute):
            return  # a method of a computed value: mask.view(...), name.endswith(...)
        raise CannotReplay(call, ctx.info, f"`{code(call)}`", "the analysis cannot tell what it does")

    def _check_callable(self, value, ctx: _Ctx, depth: int) -> None:
        """What `apply(...)` is given: a method of the class or a function of its module."""
        path = attr_path(value)
        if path and len(path) == 2 and path[0] == "self" and path[1] in ctx.info.methods:
            self.check_pure(ctx.info.methods[path[1]], ctx, depth)
            return
        if isinstance(value, cst.Name):
            fn = _top_function(ctx.resolver, value.value)
            if fn is not None:
                self.check_pure(fn, ctx, depth)
                return
        raise CannotReplay(value, ctx.info, f"`apply({code(value)})` in {ctx.info.name}.__init__",
                           "the analysis cannot read the function it applies")

    def check_pure(self, fn: cst.FunctionDef, ctx: _Ctx, depth: int) -> None:
        """A method or function that only computes and initialises (no stores on self, no modules)."""
        if depth == 0:
            raise CannotReplay(fn, ctx.info, f"`{fn.name.value}` calls too deep", "the analysis stops following calls")
        for node in _walk(fn.body, (cst.AssignTarget, cst.Call)):
            if isinstance(node, cst.AssignTarget):
                path = attr_path(node.target)
                if path and path[0] == "self":
                    raise CannotReplay(node, ctx.info, f"`{fn.name.value}` stores `{code(node.target)}`",
                                       "re-running it would change the model's structure, not only its values")
                continue
            name = _global_name(node, ctx.resolver, ctx.info) or ""
            if self.classes.is_module_class(name) or name in CONTAINERS:
                raise CannotReplay(node, ctx.info, f"`{fn.name.value}` builds `{code(node.func)}`",
                                   "re-running it would change the model's structure, not only its values")
            attr = node.func.attr.value if isinstance(node.func, cst.Attribute) else ""
            if attr in ("register_buffer", "register_parameter", "add_module", "register_module"):
                raise CannotReplay(node, ctx.info, f"`{fn.name.value}` registers state",
                                   "re-running it would change the model's structure, not only its values")
            if name and not _safe_name(name):
                inner = _top_function(ctx.resolver, name) if isinstance(node.func, cst.Name) else None
                if inner is None:
                    raise CannotReplay(node, ctx.info, f"`{code(node)}` in `{fn.name.value}`",
                                       "it is not a torch or math computation the analysis can re-run")
                self.check_pure(inner, ctx, depth - 1)

    def translate(self, node, ctx: _Ctx, bound: Set[str], renames: Optional[Dict[str, str]] = None, depth: int = 4):
        """`node` as code of the script: self -> the instance, constructor parameters ->
        their values, locals of __init__ inlined; names it needs imported."""
        translator = self
        skip = _non_variable_names(node)
        renames = renames or {}
        bound = bound | {n for c in _walk(node, (cst.CompFor,)) for n in _names(c.target)}

        class _T(cst.CSTTransformer):
            def leave_Name(self_, original: cst.Name, updated: cst.Name):
                if id(original) in skip:
                    return updated
                n = original.value
                if n in bound:
                    return cst.Name(renames.get(n, n))
                if n == "self":
                    return cst.Name(ctx.instance)
                if n in ctx.env:
                    value = ctx.env[n]
                    if value is None:
                        raise CannotReplay(original, ctx.info, f"it reads constructor argument `{n}` of {ctx.info.name}",
                                           "its value at the call site is not a name or constant the analysis can reuse")
                    return _paren(value)
                if n in ctx.locals:
                    value = ctx.locals[n]
                    if value is None or depth == 0:
                        raise CannotReplay(original, ctx.info, f"local `{n}` of {ctx.info.name}.__init__",
                                           "it is rebound or built from modules; the analysis cannot re-compute it")
                    translator.check_calls(value, ctx)
                    return _paren(translator.translate(value, ctx, bound, renames, depth - 1))
                translator._need_name(n, original, ctx)
                return updated

        return node.visit(_T())

    def _need_name(self, n: str, node, ctx: _Ctx) -> None:
        """A free name of the class's file must mean the same in the script."""
        if n in SAFE_BUILTINS or hasattr(builtins, n):
            return
        qnames = ctx.resolver.qnames(node)
        dotted = sorted(qnames)[0] if qnames else None
        if dotted is None or "<" in dotted:
            raise CannotReplay(node, ctx.info, f"name `{n}` in {ctx.info.name}", "the analysis cannot tell what it is")
        if not ctx.info.namespace:
            return  # the script's own module-level name
        imported = _top_level_bindings(ctx.resolver, definitions=False)
        # an import of the sibling module is repeated here; its own classes, functions
        # and constants are imported from it
        self._need_binding(n, imported.get(n, f"{ctx.info.namespace}.{n}"), node, ctx.info)

    def _need_binding(self, local: str, dotted: str, node, info: Optional[ClassInfo]) -> None:
        have = self.script_bindings.get(local)
        if have == dotted:
            return
        if have is not None:
            raise CannotReplay(node, info, f"`{local}` means `{dotted}` in the model's module but `{have}` here",
                               "the re-initialisation code would read the wrong object")
        module, _, obj = dotted.rpartition(".")
        if not module:
            self.imports.append((dotted, None, None))
        elif local == obj:
            self.imports.append((module, obj, None))
        else:
            self.imports.append((dotted, None, local))
        self.script_bindings[local] = dotted


# -- helpers -------------------------------------------------------------------


def _torch_nn(name: str) -> bool:
    return name.startswith("torch.nn.") and name.rsplit(".", 1)[-1][:1].isupper()


def _is_torch(name: Optional[str]) -> bool:
    return bool(name) and (name == "torch" or name.startswith("torch.")) and not name.startswith(TORCH_DATA)


def _global_name(call, resolver: Resolver, info: Optional[ClassInfo]) -> Optional[str]:
    if not isinstance(call, cst.Call):
        return None
    if info is not None and info.namer is not None:
        name = info.namer.of(call)
    else:
        names = sorted(resolver.qnames(call))
        name = names[0] if names else None
    return None if name is None or "<locals>" in name else name


def _safe_name(name: str) -> bool:
    """torch (not its data loaders), math, and a few builtins."""
    if name.startswith("builtins."):
        return name[len("builtins."):] in SAFE_BUILTINS
    return _is_torch(name) or name == "math" or name.startswith("math.")


def _calls(node) -> List[cst.Call]:
    return list(_walk(node, (cst.Call,)))


def _walk(node, kinds):
    found = []

    class _W(cst.CSTVisitor):
        def on_visit(self, n) -> bool:
            if isinstance(n, kinds):
                found.append(n)
            return True

    node.visit(_W())
    return found


def _names(node) -> Set[str]:
    return {n.value for n in _walk(node, (cst.Name,))}


def _non_variable_names(node) -> Set[int]:
    """ids of Name nodes that are not variables: attribute names, keywords."""
    skip: Set[int] = set()

    class _S(cst.CSTVisitor):
        def visit_Attribute(self, n: cst.Attribute) -> None:
            skip.add(id(n.attr))

        def visit_Arg(self, n: cst.Arg) -> None:
            if n.keyword is not None:
                skip.add(id(n.keyword))

    node.visit(_S())
    return skip


def _bound_in(stmt) -> Set[str]:
    """Names a replayed loop binds itself (its targets, comprehension and local variables)."""
    bound: Set[str] = set()
    for node in _walk(stmt, (cst.For, cst.CompFor, cst.AssignTarget)):
        bound |= _names(node.target)
    return bound


def _plain(expr) -> bool:
    """A value that can be read again: names, attributes of names, constants."""
    if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString)):
        return True
    if isinstance(expr, cst.UnaryOperation):
        return _plain(expr.expression)
    path = attr_path(expr)
    return path is not None


def _paren(expr: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float, cst.SimpleString)):
        return expr
    return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def _defaults(init: cst.FunctionDef) -> Dict[str, Optional[cst.BaseExpression]]:
    out: Dict[str, Optional[cst.BaseExpression]] = {}
    for p in list(init.params.params) + list(init.params.kwonly_params):
        if p.name.value == "self":
            continue
        out[p.name.value] = p.default if p.default is not None and _plain(p.default) and not attr_path(p.default) else None
    return out


def _top_function(resolver: Resolver, name: str) -> Optional[cst.FunctionDef]:
    short = name.rsplit(".", 1)[-1]
    return next(
        (s for s in resolver.module.body if isinstance(s, cst.FunctionDef) and s.name.value == short), None
    )


def _top_level_bindings(resolver: Resolver, definitions: bool = True) -> Dict[str, str]:
    """Names a module binds at its top level by import (local -> dotted), and its classes and functions."""
    out: Dict[str, str] = {}
    for stmt in resolver.module.body:
        if definitions and isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            out[stmt.name.value] = stmt.name.value
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, (cst.Import, cst.ImportFrom)):
                out.update(import_bindings(small, keep_relative=True))
    return out


def _render(stmt: cst.CSTNode) -> str:
    return cst.Module(body=[stmt]).code


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


# -- the build statement --------------------------------------------------------

DTYPE_METHODS = {"half", "float", "double", "bfloat16"}
KEPT_METHODS = {"train", "eval", "requires_grad_"}
TORCH_DTYPES = {
    "float16", "float32", "float64", "bfloat16", "half", "float", "double", "int8", "int16", "int32", "int64",
    "long", "int", "uint8", "bool", "complex64", "complex128",
}


def split_device_moves(expr: cst.BaseExpression, resolver: Resolver):
    """(`expr` without its device moves, the last device it moves to) for a build or
    placement chain: `Net().to(device)` -> (`Net()`, `device`); `.cuda()` -> "cuda".
    dtype changes and mode switches stay (they work on meta tensors). Raises
    CannotReplay for a move the meta build cannot express (`.to(device, dtype)`, `.cuda(1)`)."""
    chain = []
    node = expr
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and \
            node.func.attr.value in DTYPE_METHODS | KEPT_METHODS | {"to", "cuda", "cpu"}:
        chain.append(node)
        node = node.func.value
    base, device = node, None
    for call in reversed(chain):  # innermost first
        method = call.func.attr.value
        if method == "cuda" or method == "cpu":
            if call.args:
                raise CannotReplay(call, None, f"`{code(call)}` names a device index",
                                   "--meta-init allocates the model with to_empty on the device set for this rank")
            device = cst.SimpleString(f'"{method}"')
            continue
        if method == "to":
            kinds = [_to_arg_kind(a, resolver) for a in call.args]
            if kinds and all(k == "dtype" for k in kinds):
                base = cst.Call(func=cst.Attribute(value=base, attr=call.func.attr), args=call.args)
                continue
            if len(kinds) == 1 and kinds[0] == "device":
                device = call.args[0].value
                continue
            raise CannotReplay(call, None, f"`{code(call)}` moves and converts the model at once",
                               "--meta-init can keep a dtype change or drop a device move, not split one call")
        base = cst.Call(func=cst.Attribute(value=base, attr=call.func.attr), args=call.args)
    return base, device


def _to_arg_kind(arg: cst.Arg, resolver: Resolver) -> str:
    if arg.keyword is not None:
        return {"device": "device", "dtype": "dtype"}.get(arg.keyword.value, "other")
    names = resolver.qnames(arg.value)
    if any(n.startswith("torch.") and n.rsplit(".", 1)[-1] in TORCH_DTYPES for n in names):
        return "dtype"
    return "device"
