"""Checkpoint sites of a script: what each torch.save writes, what each torch.load
feeds, and the rank-0 branches around them.

The checkpoint stages ask these questions; the answers are computed on demand
(most scripts save once or twice), from the facts of one analysis.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

import libcst as cst

from .facts import ScriptFacts
from .rank_bindings import RankZeroRead, rank_zero_reads
from .rank_values import rank_aliases
from fsdp2_retrofit.syntax.names import (
    assigned_names, bind_args, calls_in, code, dotted, last_assignment, names_read, parameter_names, walk,
)
from fsdp2_retrofit.syntax.rank import is_rank_test, mentions_rank_test, split_rank_test  # noqa: F401  (stages import them from here)
from fsdp2_retrofit.syntax.torch_api import TORCH_LOAD as LOAD, TORCH_SAVE as SAVE


@dataclass
class StateCall:
    """A `x.state_dict()` call of a model or optimizer inside a saved object."""

    call: cst.Call
    kind: str  # "model" | "optimizer"
    owner: str  # the name it is called on
    model: str  # the model (for an optimizer: the model it trains)


@dataclass
class SaveSite:
    call: cst.Call
    stmt: cst.CSTNode
    state: cst.BaseExpression  # what is saved, seen through a name bound just before
    path: cst.BaseExpression
    path_key: str
    state_calls: List[StateCall] = field(default_factory=list)
    whole_model: Optional[str] = None  # torch.save(model, path)
    # `torch.save({"net": net, ...}, path)`: models saved whole inside a dict, list or tuple literal
    held_models: List[Tuple[str, cst.CSTNode]] = field(default_factory=list)
    dict_keys: Tuple[str, ...] = ()  # the keys of a saved dict literal
    # (node, why) for each optimizer state_dict() whose optimizer or model was lost on the way
    lost: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)
    # `def save_checkpoint(state, filename): torch.save(state, filename)`: the calls that hand the
    # parameter a model's or optimizer's state (`save_checkpoint({"state_dict": model.state_dict()}, p)`)
    handed_state: List[cst.Call] = field(default_factory=list)
    # (name, state_dict() call): a name inside the saved object bound to a container that holds a model's
    # or optimizer's state (`states = {"model_states": model_states}`, `model_states = {"net": net.state_dict()}`)
    nested_state: List[Tuple[cst.Name, cst.Call]] = field(default_factory=list)

    @property
    def model_only(self) -> bool:
        return bool(self.state_calls) and all(s.kind == "model" for s in self.state_calls)


@dataclass
class LoadUse:
    """One read of what torch.load returned."""

    node: cst.CSTNode  # the expression that reads it (`ckpt["model"]`, `ckpt`)
    stmt: cst.CSTNode
    key: Optional[str]  # None: the whole object
    kind: str  # "model" | "optimizer" | "stateful" (other .load_state_dict) | "value"
    owner: Optional[str] = None  # the object whose load_state_dict receives it
    model: Optional[str] = None
    call: Optional[cst.Call] = None  # the load_state_dict call
    lost: Optional[Tuple[cst.CSTNode, str]] = None  # (where, why) an optimizer handed here was lost (held_values)


@dataclass
class LoadSite:
    call: cst.Call  # torch.load(...)
    stmt: cst.CSTNode
    path: cst.BaseExpression
    path_key: str
    var: Optional[str]  # `ckpt = torch.load(...)`; None for `model.load_state_dict(torch.load(...))`
    uses: List[LoadUse] = field(default_factory=list)
    unknown_use: Optional[cst.CSTNode] = None  # a read that is not `ckpt[KEY]` / `ckpt.get(KEY)`

    @property
    def loads_state(self) -> bool:
        return any(u.kind in ("model", "optimizer") for u in self.uses)


def save_format(site: SaveSite, export: str) -> Optional[str]:
    """How a save is written after the rewrite: "dcp" (a checkpoint directory), "full"
    (one torch.save file of the full state dict, --export full), None (left alone)."""
    if not site.state_calls and site.whole_model is None:
        return None
    if export == "full" and (site.whole_model is not None or site.model_only):
        return "full"
    return "dcp"


def optimizer_lost(facts: ScriptFacts, function, owner: str, at: cst.CSTNode) -> Optional[Tuple[cst.CSTNode, str]]:
    """(where, why) when `owner` in `function` is an optimizer whose value, or the model it
    trains, the analysis lost on the way (held_values); None when it is followed or no optimizer."""
    lost = facts.lost_optimizers.get((function, owner))
    if lost is not None:
        return lost
    optimizers = facts.optimizer_names.get(function, {})
    if owner in optimizers and not optimizers[owner]:
        return at, f"`{owner}` trains several models, or one that is not known here by a name"
    return None


def calls_to(facts: ScriptFacts, names) -> List[cst.Call]:
    return [c for c in facts.resolver.nodes(cst.Call) if facts.resolver.is_call_to(c, names)]


def bound_value(name: str, node: cst.CSTNode, facts: ScriptFacts) -> Optional[cst.BaseExpression]:
    """The value `name` was last given in the same block before `node`'s statement, or
    in an enclosing block of the same function before the `if`/`with`/... holding it
    (`checkpoint = {...}` then `if best: torch.save(checkpoint, path)`)."""
    r = facts.resolver
    stmt = r.statement_of(node)
    function = r.enclosing_function(stmt)
    earlier = None
    while stmt is not None and earlier is None:
        block = r.block_of(stmt)
        earlier = last_assignment(name, stmt, block) if block is not None else None
        if earlier is not None or block is None or any(name in assigned_names(s) for s in block.body):
            break  # bound in this block only after the save (a loop): not followed upwards
        holder = r.parent(block)
        if not isinstance(holder, (cst.If, cst.Else, cst.With, cst.Try)) or r.enclosing_function(holder) is not function:
            break
        while isinstance(holder, (cst.Else, cst.If)) and isinstance(r.parent(holder), cst.If):
            holder = r.parent(holder)  # `elif` / `else` branches: the outermost `if`
        stmt = holder
    if earlier is None or len(earlier.body) != 1 or not isinstance(earlier.body[0], cst.Assign):
        return None
    return earlier.body[0].value


def binding_statement(name: str, node: cst.CSTNode, facts: ScriptFacts) -> Optional[cst.CSTNode]:
    """The statement of `node`'s block that last binds `name` before it."""
    stmt = facts.resolver.statement_of(node)
    block = facts.resolver.block_of(stmt)
    return last_assignment(name, stmt, block) if block is not None else None


def path_key(expr, facts: ScriptFacts, depth: int = 3) -> str:
    """A path's text, seeing through a name bound once in the function (`best_path = ...`)
    and through a parameter every call of its function hands the same path (a save helper's
    `path`, a load helper's `ckpt_path`: both `args.ckpt`, whatever they are called)."""
    if isinstance(expr, cst.Name):
        function = facts.resolver.enclosing_function(expr)
        values = [
            s.body[0].value
            for s in facts.resolver.nodes(cst.SimpleStatementLine)
            if len(s.body) == 1
            and isinstance(s.body[0], cst.Assign)
            and expr.value in assigned_names(s)
            and facts.resolver.enclosing_function(s) is function
        ]
        if len(values) == 1:
            return code(values[0])
        if not values and function is not None and depth and expr.value in parameter_names(function):
            passed = [dict(bind_args(function, c)).get(expr.value) for c in facts.resolver.nodes(cst.Call)
                      if isinstance(c.func, cst.Name) and c.func.value == function.name.value]
            keys = {path_key(a, facts, depth - 1) if a is not None else None for a in passed}
            if len(keys) == 1 and None not in keys:
                return keys.pop()
    return code(expr)


def call_arg(call: cst.Call, index: int, keyword: str) -> Optional[cst.BaseExpression]:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == keyword:
            return a.value
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[index].value if len(positional) > index else None


def saves(facts: ScriptFacts) -> List[SaveSite]:
    """Every torch.save of the script, with the model/optimizer state it writes."""
    out = []
    for call in calls_to(facts, SAVE):
        obj, path = call_arg(call, 0, "obj"), call_arg(call, 1, "f")
        if obj is None or path is None:
            continue
        function = facts.resolver.enclosing_function(call)
        models = facts.model_names.get(function, set())
        optimizers = facts.optimizer_names.get(function, {})
        state = obj
        if isinstance(obj, cst.Name) and obj.value not in models:
            state = bound_value(obj.value, call, facts)
            if state is None:
                handed = _calls_handing_state(function, obj.value, facts)
                if handed:
                    site = SaveSite(call, facts.resolver.statement_of(call), obj, path, path_key(path, facts))
                    site.handed_state = handed
                    out.append(site)
                continue
        site = SaveSite(call, facts.resolver.statement_of(call), state, path, path_key(path, facts))
        if isinstance(state, cst.Name) and state.value in models:
            site.whole_model = state.value
        for sd in _state_dict_calls(state):
            owner = sd.func.value
            if not isinstance(owner, (cst.Name, cst.Attribute)):
                continue
            key = dotted(owner)
            lost = optimizer_lost(facts, function, key, sd)
            if lost is not None:
                site.lost.append(lost)
            elif key in optimizers:
                # `optimizer._optimizer.state_dict()`: the torch optimizer a wrapper holds;
                # `self.optimizer.state_dict()`: the optimizer an object was handed
                site.state_calls.append(StateCall(sd, "optimizer", key, optimizers[key]))
            elif key in models:
                site.state_calls.append(StateCall(sd, "model", key, key))
        if isinstance(state, (cst.Dict, cst.List, cst.Tuple)):
            values = [e.value for e in state.elements if isinstance(e, (cst.DictElement, cst.Element))]
            site.held_models = [(v.value, v) for v in values if isinstance(v, cst.Name) and v.value in models]
            site.nested_state = _nested_state(values, call, set(models) | set(optimizers), facts, 3)
        elif isinstance(state, cst.Call) and not _state_dict_calls(state):
            # `asdict(snapshot)`, `Snapshot(model_state=sd, ...)`: the state through a record's arguments
            site.nested_state = _nested_state([a.value for a in state.args], state, set(models) | set(optimizers),
                                              facts, 3)
        if isinstance(state, cst.Dict):
            site.dict_keys = tuple(
                e.key.evaluated_value
                for e in state.elements
                if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)
            )
        out.append(site)
    return out


def _calls_handing_state(function, param: str, facts: ScriptFacts) -> List[cst.Call]:
    """The calls of the script's function `function` that bind its parameter `param` to an expression
    holding a model's or an optimizer's `state_dict()` (inline, or through a name bound just before)."""
    if function is None or param not in parameter_names(function):
        return []
    found = []
    for c in facts.resolver.nodes(cst.Call):
        func = c.func
        called = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else None
        if called != function.name.value:
            continue
        arg = dict(bind_args(function, c)).get(param)
        if isinstance(arg, cst.Name):
            arg = bound_value(arg.value, c, facts)
        if arg is None:
            continue
        caller = facts.resolver.enclosing_function(c)
        known = set(facts.model_names.get(caller, set())) | set(facts.optimizer_names.get(caller, {}))
        for sd in _state_dict_calls(arg):
            owner = sd.func.value
            if isinstance(owner, (cst.Name, cst.Attribute)) and dotted(owner) in known:
                found.append(c)
                break
    return found


def loads(facts: ScriptFacts) -> List[LoadSite]:
    """Every torch.load of the script and what reads its result."""
    out = []
    for call in calls_to(facts, LOAD):
        path = call_arg(call, 0, "f")
        if path is None:
            continue
        stmt = facts.resolver.statement_of(call)
        site = LoadSite(call, stmt, path, path_key(path, facts), None)
        parent = facts.resolver.parent(call)
        if (
            isinstance(stmt, cst.SimpleStatementLine)
            and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Assign)
            and stmt.body[0].value is call
            and len(stmt.body[0].targets) == 1
            and isinstance(stmt.body[0].targets[0].target, cst.Name)
        ):
            site.var = stmt.body[0].targets[0].target.value
            _collect_uses(site, facts)
        elif isinstance(parent, cst.Arg):
            use = _load_state_dict_use(call, None, stmt, facts)
            if use is not None:
                site.uses.append(use)
        out.append(site)
    return out


def _collect_uses(site: LoadSite, facts: ScriptFacts) -> None:
    r = facts.resolver
    function = r.enclosing_function(site.stmt)
    target = site.stmt.body[0].targets[0].target
    after = False
    for name in r.nodes(cst.Name):
        if name is target:
            after = True
            continue
        if not after or name.value != site.var or r.enclosing_function(name) is not function:
            continue
        parent = r.parent(name)
        if isinstance(parent, cst.Attribute) and parent.attr is name:  # `args.ckpt`
            continue
        stmt = r.statement_of(name)
        if stmt is site.stmt:
            continue
        if site.var in assigned_names(stmt):  # rebound: later reads are of something else
            break
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Del):
            continue
        key = None
        node = name
        if isinstance(parent, cst.Subscript) and len(parent.slice) == 1:
            index = parent.slice[0].slice
            if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
                key, node = index.value.evaluated_value, parent
        elif isinstance(parent, cst.Attribute) and parent.attr.value == "get":
            call = r.parent(parent)
            if isinstance(call, cst.Call) and call.args and isinstance(call.args[0].value, cst.SimpleString):
                key, node = call.args[0].value.evaluated_value, call
        use = _load_state_dict_use(node, key, stmt, facts)
        if use is not None:
            site.uses.append(use)
        elif key is not None:
            site.uses.append(LoadUse(node, stmt, key, "value"))
        elif site.unknown_use is None:
            site.unknown_use = name


def _load_state_dict_use(node, key, stmt, facts: ScriptFacts) -> Optional[LoadUse]:
    """`owner.load_state_dict(node)` as a statement of its own."""
    r = facts.resolver
    arg = r.parent(node)
    call = r.parent(arg) if isinstance(arg, cst.Arg) else None
    if not (
        isinstance(call, cst.Call)
        and isinstance(call.func, cst.Attribute)
        and call.func.attr.value == "load_state_dict"
        and isinstance(call.func.value, (cst.Name, cst.Attribute))
        and call.args[0] is arg
        and isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and stmt.body[0].value is call
    ):
        return None
    owner = dotted(call.func.value)
    function = r.enclosing_function(call)
    optimizers = facts.optimizer_names.get(function, {})
    models = facts.model_names.get(function, set())
    lost = facts.lost_optimizers.get((function, owner))
    if isinstance(call.func.value, cst.Attribute) and owner not in optimizers and owner not in models and not lost:
        # only `optimizer._optimizer` (the torch optimizer a wrapper holds) and `self.<attr>`
        # holding a model or an optimizer (held_values) are read through
        return None
    if lost is not None:
        return LoadUse(node, stmt, key, "optimizer", owner, None, call, lost)
    if owner in models:
        return LoadUse(node, stmt, key, "model", owner, owner, call)
    if owner in optimizers:
        return LoadUse(node, stmt, key, "optimizer", owner, optimizers[owner], call)
    return LoadUse(node, stmt, key, "stateful", owner, None, call)


def _nested_state(values, at: cst.CSTNode, owners: Set[str], facts: ScriptFacts, depth: int):
    """(name, state_dict() call) for each name among `values` bound (before `at`) to a dict, list or tuple
    literal, or to a call of a record or converter (`Snapshot(model_state=...)`, `asdict(snapshot)`), holding
    a model's or optimizer's `state_dict()`, directly or through such names again."""
    out = []
    for value in values:
        if not isinstance(value, cst.Name) or depth == 0:
            continue
        bound = bound_value(value.value, at, facts)
        if not isinstance(bound, (cst.Dict, cst.List, cst.Tuple, cst.Call)):
            continue
        held = [sd for sd in _state_dict_calls(bound)
                if isinstance(sd.func.value, (cst.Name, cst.Attribute)) and dotted(sd.func.value) in owners]
        if held:
            out.append((value, held[0]))
            continue
        if isinstance(bound, cst.Call):  # the names it is handed, each as bound before this call
            inner, where = [a.value for a in bound.args], bound
        else:
            inner, where = [e.value for e in bound.elements if isinstance(e, (cst.DictElement, cst.Element))], at
        deeper = _nested_state(inner, where, owners, facts, depth - 1)
        out += [(value, sd) for _, sd in deeper[:1]]
    return out


def _state_dict_calls(node) -> List[cst.Call]:
    return [
        n for n in calls_in(node)
        if type(n.func) is cst.Attribute and n.func.attr.value == "state_dict" and not n.args
    ]


PLAIN_CALLS = {"int", "float", "len", "round", "str", "bool", "min", "max", "sum", "abs", "dict", "list", "vars"}


def may_be_tensor(expr: Optional[cst.BaseExpression], facts: ScriptFacts) -> bool:
    """Whether a saved value might be a tensor (`loss`), not a plain Python value
    (`step`, `epoch`, `loss.item()`, a literal): a name counts when an assignment in its
    function binds it to a call other than int(), float(), len(), ..."""
    if expr is None:
        return False
    if isinstance(expr, (cst.BaseNumber, cst.BaseString, cst.Dict, cst.List, cst.Tuple)):
        return False
    if isinstance(expr, cst.Call):
        func = expr.func
        if isinstance(func, cst.Attribute) and func.attr.value in (
                "item", "tolist", "state_dict", "parse_args", "get_state", "getstate"):  # Namespace, RNG tuples
            return False
        return not (isinstance(func, cst.Name) and func.value in PLAIN_CALLS)
    if isinstance(expr, cst.Name):
        function = facts.resolver.enclosing_function(expr)
        for stmt in facts.resolver.nodes(cst.SimpleStatementLine):
            if facts.resolver.enclosing_function(stmt) is not function or expr.value not in assigned_names(stmt):
                continue
            small = stmt.body[0]
            if isinstance(small, cst.Assign) and isinstance(small.value, cst.Call) and may_be_tensor(small.value, facts):
                return True
        return False
    return isinstance(expr, (cst.Subscript, cst.Attribute, cst.BinaryOperation))


def rank_gate(node: cst.CSTNode, facts: ScriptFacts) -> Optional[cst.If]:
    """The innermost `if` of the same function around `node` whose test mentions a rank (by name,
    or by value: `if self.gpu_id == 0:` with `self.gpu_id = int(os.environ["LOCAL_RANK"])`)."""
    for anc in facts.resolver.ancestors(node):
        if isinstance(anc, cst.FunctionDef):
            return None
        if isinstance(anc, cst.If) and mentions_rank_test(anc.test, rank_aliases(anc, facts)) and _in_body(node, anc, facts):
            return anc
    return None


def rank_zero_names(stmt: cst.CSTNode, facts: ScriptFacts, split=()) -> List[RankZeroRead]:
    """The names bound under rank-0 `if`s (`if rank == 0: run_dir = ...`) that the values `stmt`
    reads come from, directly or through assignments and arguments every rank runs (`path =
    f"{run_dir}/m.pt"`), in a function or at module level: on the other ranks they do not
    exist, or hold a value of their own (`run_dir = None` before the `if`, or in its `else`:
    the read's `otherwise`), so a save that now runs on every rank would fail there or write
    elsewhere. Assignments under the `if`s in `split` (split around a save) run on every rank
    already."""

    r = facts.resolver

    def everywhere(node) -> bool:
        gate = rank_gate(node, facts)
        return gate is None or any(gate is g for g in split)

    def only_on_rank_zero(function, name, at):
        bindings = [s for s in r.descendants(function.body if function is not None else facts.module,
                                             cst.SimpleStatementLine)
                    if name in assigned_names(s) and r.enclosing_function(s) is function]
        if not bindings or name in _bound_otherwise_in(function):
            return None
        gated = [b for b in bindings if not everywhere(b)]
        if not gated:
            return None
        gate = rank_gate(gated[0], facts)
        others = [b for b in bindings if everywhere(b)]
        if not others:
            return gated[0], gate
        # the other ranks' own value, bound before the `if` or in its else: rank 0's replaces it
        # where the save reads it; bound after it, the name is not rank 0's alone
        if any(r.order(b) > r.order(gate) and not _in_else(b, gate, facts) for b in others):
            return None
        return gated[0], gate, others[0]

    def _bound_otherwise_in(function) -> set:
        found = cache.get(id(function))
        if found is None:
            # every node of the body (`descendants` takes one exact type: CSTNode, an ABC, matched none)
            body = function.body if function is not None else facts.module
            found = cache[id(function)] = set().union(
                *(_bound_otherwise(n) for n in walk(body) if type(n) in _BINDERS
                  and (function is not None or r.enclosing_function(n) is None))
            )
        return found

    cache: dict = {}
    return rank_zero_reads(r, stmt, names_read(stmt), only_on_rank_zero, everywhere)


def _in_else(node, gate: cst.If, facts: ScriptFacts) -> bool:
    """`node` is in the `else:` (or an `elif`) of `gate`."""
    return gate.orelse is not None and any(a is gate.orelse for a in facts.resolver.ancestors(node))


# statements and expressions that bind a name otherwise than by assignment (exact types:
# libcst has no subclasses of these)
_BINDERS = frozenset({cst.For, cst.With, cst.FunctionDef, cst.ClassDef, cst.Import, cst.ImportFrom,
                      cst.NamedExpr, cst.Global, cst.Nonlocal, cst.AugAssign})


def _bound_otherwise(node) -> set:
    """Names bound by a statement other than a plain assignment (for/with targets, defs, imports, ...)."""
    from fsdp2_retrofit.syntax.names import names_in

    if isinstance(node, cst.For):
        return names_in(node.target)
    if isinstance(node, cst.With):
        return set().union(*(names_in(i.asname.name) for i in node.items if i.asname is not None))
    if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
        return {node.name.value}
    if isinstance(node, cst.NamedExpr):
        return names_in(node.target)
    if isinstance(node, cst.AugAssign):
        return set()  # `x += 1` needs an earlier binding: that one decides
    if isinstance(node, (cst.Global, cst.Nonlocal)):
        return {n.name.value for n in node.names}
    if isinstance(node, (cst.Import, cst.ImportFrom)) and not isinstance(node.names, cst.ImportStar):
        return {(a.asname.name.value if a.asname is not None and isinstance(a.asname.name, cst.Name)
                 else code(a.name).split(".")[0]) for a in node.names}
    return set()


def _in_body(node, if_node: cst.If, facts: ScriptFacts) -> bool:
    for anc in facts.resolver.ancestors(node):
        if anc is if_node.body:
            return True
        if anc is if_node:
            return False
    return False


# -- checkpoints written or read through a file object -------------------------------

OPENERS = {"builtins.open", "io.open", "io.BytesIO", "gzip.open", "bz2.open", "lzma.open", "tempfile.TemporaryFile",
           "tempfile.NamedTemporaryFile", "tempfile.SpooledTemporaryFile"}


@dataclass
class FileObject:
    """The file object a torch.save / torch.load is given instead of a path."""

    name: str  # `f`
    with_stmt: Optional[cst.With]  # `with open(path, "wb") as f:`; None: bound otherwise
    path: Optional[cst.BaseExpression]  # the opened path, where the file can take its place
    problem: str = ""  # why the path cannot take the file's place ("" when it can)


def file_object(call: cst.Call, arg: cst.BaseExpression, writing: bool, facts: ScriptFacts) -> Optional[FileObject]:
    """`arg` (the file argument of `call`) seen as a file object: the target of an
    enclosing `with open(...) as f`, or a name bound to open(...) / io.BytesIO() /
    gzip.open(...) in the same function. None where it is a path (or unknown: a
    function's parameter is taken to be a path, as before)."""
    r = facts.resolver
    if isinstance(arg, cst.Call) and r.is_call_to(arg, OPENERS):
        return FileObject(code(arg), None, None, "the file is opened inside the call")
    if not isinstance(arg, cst.Name):
        return None
    for anc in r.ancestors(call):
        if isinstance(anc, cst.FunctionDef):
            break
        if not isinstance(anc, cst.With):
            continue
        for item in anc.items:
            if item.asname is not None and isinstance(item.asname.name, cst.Name) and item.asname.name.value == arg.value:
                return _with_file(anc, item, arg, call, writing, facts)
    function = r.enclosing_function(call)
    for stmt in r.nodes(cst.SimpleStatementLine):
        if r.enclosing_function(stmt) is not function or arg.value not in assigned_names(stmt):
            continue
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and r.is_call_to(small.value, OPENERS):
            return FileObject(arg.value, None, None, f"`{arg.value}` is bound to `{code(small.value)}`")
    return None


def _with_file(stmt: cst.With, item: cst.WithItem, arg: cst.Name, call: cst.Call, writing: bool,
               facts: ScriptFacts) -> FileObject:
    r = facts.resolver
    opened = item.item
    found = FileObject(arg.value, stmt, None)
    if not (isinstance(opened, cst.Call) and r.is_call_to(opened, {"builtins.open", "io.open"})):
        found.problem = f"`{arg.value}` is `{code(opened)}`, not a file opened by path"
        return found
    path, mode = call_arg(opened, 0, "file"), call_arg(opened, 1, "mode")
    wanted = "w" if writing else "r"
    if path is None or not isinstance(mode, cst.SimpleString) or len(opened.args) > 2:
        found.problem = "the file is opened with a mode or options the tool does not read"
        return found
    letters = set(mode.evaluated_value)
    if not ("b" in letters and wanted in letters and letters <= {wanted, "b"}):
        found.problem = f"the file is opened with mode {mode.value}, not {'wb' if writing else 'rb'}"
        return found
    if len(stmt.items) != 1 or stmt.asynchronous is not None or not isinstance(stmt.body, cst.IndentedBlock):
        found.problem = "the `with` opens more than the one file"
        return found
    reads = [n for n in _nodes_of(stmt.body, cst.Name) if n.value == arg.value]
    if len(reads) != 1 or reads[0] is not arg:
        found.problem = f"`{arg.value}` is used for more than the {'save' if writing else 'load'}"
        return found
    if read_names(path) & set().union(*(assigned_names(s) for s in stmt.body.body)):
        found.problem = "the path is changed inside the `with`"
        return found
    found.path = path
    return found


def read_names(expr) -> Set[str]:
    """The variables an expression reads (`args` of `args.ckpt`, not `ckpt`)."""
    attrs = {id(n.attr) for n in _nodes_of(expr, cst.Attribute)}
    return {n.value for n in _nodes_of(expr, cst.Name) if id(n) not in attrs}


def target_names(stmt) -> Set[str]:
    """Every variable an assignment inside `stmt` binds or changes (`args` of `args.out = ...`)."""
    targets = [t.target for t in _nodes_of(stmt, cst.AssignTarget)]
    targets += [n.target for n in _nodes_of(stmt, (cst.AugAssign, cst.AnnAssign))]
    return set().union(assigned_names(stmt), *(read_names(t) for t in targets))


def _nodes_of(node, kind) -> list:
    return [n for n in walk(node) if isinstance(n, kind)]


def saved_dict_keys(expr: Optional[cst.BaseExpression], facts: ScriptFacts) -> Optional[Tuple[str, ...]]:
    """The keys of a dict a checkpoint saves as a value (`"model_args": model_args`), where
    they are fixed in the source: a dict literal with string keys, `dict(k=...)`, or a name
    every binding of which in its function is one of those with the same keys (or a read
    from a checkpoint: `model_args = ckpt["model_args"]`). None: not known to be such a dict.
    DCP flattens a saved dict into one entry a key, so its load needs the same keys."""
    keys = _literal_keys(expr)
    if keys is not None or not isinstance(expr, cst.Name):
        return keys
    r = facts.resolver
    function = r.enclosing_function(expr)
    found = set()
    for target in r.nodes(cst.AssignTarget):
        if r.enclosing_function(target) is not function or expr.value not in read_names(target.target):
            continue
        assign = r.parent(target)
        if not (isinstance(target.target, cst.Name) and isinstance(assign, cst.Assign)):
            return None  # `model_args["x"] = ...`, a tuple target: the keys may change
        if isinstance(assign.value, cst.Subscript):
            continue
        keys = _literal_keys(assign.value)
        if keys is None:
            return None
        found.add(keys)
    return found.pop() if len(found) == 1 else None


def _literal_keys(expr) -> Optional[Tuple[str, ...]]:
    if isinstance(expr, cst.Dict) and all(
        isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString) for e in expr.elements
    ):
        return tuple(e.key.evaluated_value for e in expr.elements)
    if (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Name)
        and expr.func.value == "dict"
        and all(a.keyword is not None and not a.star for a in expr.args)
    ):
        return tuple(a.keyword.value for a in expr.args)
    return None
