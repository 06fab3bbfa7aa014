"""Where a model's build ends, and fully_shard goes: the statements after `model = Net()`
that still make the module fully_shard must see (placement, in-place initialisation,
freezing, a new head, `init_head(model)`), up to the first that uses it (an optimizer,
a forward, a loop, a trainer's construction).

The statement predicates are plain functions (no_model.py and model_builds.py read
placement chains too); ShardAnchors answers on one analysis, which knows the script's
functions and where its optimizers are built.
"""
from __future__ import annotations

from typing import Optional

import libcst as cst

from .flow import innermost_call
from .init_branches import branch_initialises, initialised_name, initialised_names
from .library_models import PEFT_WRAPPERS
from fsdp2_retrofit.syntax.names import PLACEMENT_METHODS, assigned_names, bind_args, calls_in, names_in, root_name
from fsdp2_retrofit.syntax.torch_api import TORCH_COMPILE, TORCH_LOAD


class ShardAnchors:
    """The shard anchor of each model of one analysis (site_analysis.SiteAnalysis). ModelAnalysis
    sets `building_classes` (trainer classes whose methods build an optimizer) and
    `optimizer_stmts` (ids of the optimizers' statements) once it has found the optimizers: a
    trained model's anchor stops before either."""

    def __init__(self, site) -> None:
        self.site = site
        self.r = site.r
        self.building_classes = set()
        self.optimizer_stmts = set()

    def anchor(self, name: str, stmt, block, frozen: bool = False) -> cst.CSTNode:
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
            if not frozen and any(type(c.func) is cst.Name and c.func.value in self.building_classes
                                  for c in calls_in(later)):
                break  # `Trainer(model, ...)`, whose methods build the optimizer: the model is sharded before it
            if not frozen and type(later) is not cst.SimpleStatementLine and any(
                    id(s) in self.optimizer_stmts for s in self.r.descendants(later, cst.SimpleStatementLine)):
                break  # `if adam: opt = Adam(model.parameters()) else: ...`: no stage moves a branch, shard before it
            if isinstance(later, (cst.For, cst.While, cst.FunctionDef, cst.With, cst.Try)):
                break
            if (_is_placement(later, name) or _initialises(later, name) or self._initialises_through(later, name)
                    or _converts_sync_batchnorm(later, name) or self.places_through(later, name)):
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
        function = self.site._callee(call)
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

    def places_through(self, stmt, name: str) -> bool:
        """`to_bf16(model, device)` or `model = prepare(model, device)`: a call of a function of the
        script or of a project module it imports, handed the model, whose body only places or casts
        it (`m.to(device).to(torch.bfloat16)`, `m = m.half()`, an `if`/`else` of such, `return m`):
        part of the build, like the same calls written inline, so fully_shard comes after it and
        takes the parameters in their final dtype. Assigned back to the model's name, every
        `return` must hand back the module it was handed."""
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            return False
        small = stmt.body[0]
        rebinds = isinstance(small, cst.Assign)
        if rebinds and not (len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)
                            and small.targets[0].target.value == name):
            return False
        call = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
        if type(call) is not cst.Call:
            return False
        function = self.site._callee(call) or (self.site._sibling_function(call) or (None,))[0]
        if function is None or not isinstance(function.body, cst.IndentedBlock):
            return False
        handed = [p for p, arg in bind_args(function, call) if type(arg) is cst.Name and arg.value == name]
        if len(handed) != 1:
            return False
        param, returned = handed[0], False
        body = list(function.body.body)
        if body and _docstring(body[0]):
            body = body[1:]
        for inner in body:
            if _is_placement(inner, param):
                continue
            small = inner.body[0] if isinstance(inner, cst.SimpleStatementLine) and len(inner.body) == 1 else None
            if not isinstance(small, cst.Return) or small.value is None or not _is_placement_chain(small.value, param):
                return False
            returned = True
        return bool(body) and (returned or not rebinds)

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

    def rebound_by(self, name: str, stmt, block) -> Optional[cst.CSTNode]:
        """The statement `name = Wrapper(name, ...)` that rebinds the model to an object
        wrapping it, where anchor() stops (torch.compile, placement and PEFT, which has
        its own refusal, excepted)."""
        body = list(block.body)
        for later in body[body.index(stmt) + 1 :]:
            if isinstance(later, (cst.For, cst.While, cst.FunctionDef, cst.With, cst.Try)) and not restructures(later, name):
                return None
            if name not in assigned_names(later) or _is_placement(later, name) or _converts_sync_batchnorm(later, name):
                continue
            small = later.body[0]
            call = innermost_call(small.value) if isinstance(small, cst.Assign) else None
            if (call is None or self.r.is_call_to(call, TORCH_COMPILE) or self.r.calls_prefix(small.value, PEFT_WRAPPERS)
                    or not any(isinstance(a.value, cst.Name) and a.value.value == name for a in call.args)):
                return None
            if self._hands_back(call, name):
                continue
            return later
        return None

    def used_before(self, name: str, stmt, later, block) -> Optional[cst.CSTNode]:
        """The first statement after the build `stmt` and before `later` (both of `block`) that
        uses the module: takes its parameters (an optimizer), runs its forward or hands it to a
        function. None when nothing between them does."""
        body = list(block.body)
        for between in body[body.index(stmt) + 1 : body.index(later)]:
            if isinstance(between, (cst.FunctionDef, cst.ClassDef)) and name not in names_in(between):
                continue
            if _consumes(between, name):
                return between
        return None

    def _hands_back(self, call: cst.Call, name: str) -> bool:
        """`model = train_model(model, ...)` where the script's function returns the module it was handed (its
        parameter, followed by value): the name holds the same module again, not a wrapper."""
        arg = next(a.value for a in call.args if isinstance(a.value, cst.Name) and a.value.value == name)
        flow = self.site.flow
        # the name's bindings are not told apart by position: this very call is among what it holds
        held, returned = flow.values(arg) - {call}, flow.values(call) - {call}
        return bool(held) and arg not in held and returned == held


def _is_placement(stmt, name: str) -> bool:
    """`m.to(d)`, `m = m.cuda()`, or an `if` (with `elif`/`else` branches or not) each of
    whose branches only does such things, to `m` and to other names (`if cuda: G = G.cuda();
    D = D.cuda(); loss_fn.cuda()`, `if args.bf16: m = m.to(device).bfloat16() else: m = m.to(device)`)."""
    if isinstance(stmt, cst.If):
        branches = _branches(stmt)
        placed = [_placed_name(s) for inner in branches for s in inner]
        return all(branches) and None not in placed and name in placed
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


def _branches(stmt: cst.If) -> list:
    """The statements of each branch of an `if`/`elif`/`else`."""
    out = []
    node = stmt
    while node is not None:
        body = node.body
        out.append(list(body.body) if isinstance(body, cst.IndentedBlock) else [body])
        orelse = node.orelse if isinstance(node, cst.If) else None
        node = orelse if isinstance(orelse, cst.If) else None
        if isinstance(orelse, cst.Else):
            body = orelse.body
            out.append(list(body.body) if isinstance(body, cst.IndentedBlock) else [body])
    return out


def _docstring(stmt) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def _converts_sync_batchnorm(stmt, name: str) -> bool:
    """`name = nn.SyncBatchNorm.convert_sync_batchnorm(name)`: the same module with its BatchNorm layers
    replaced (a DDP script's), not a wrapper: fully_shard goes after it."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    if not (isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)
            and small.targets[0].target.value == name):
        return False
    value = small.value
    return (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute)
            and value.func.attr.value == "convert_sync_batchnorm" and bool(value.args)
            and isinstance(value.args[0].value, cst.Name) and value.args[0].value.value == name)


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
