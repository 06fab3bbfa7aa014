"""The other readers of a DataLoader's batch size, for --keep-global-batch.

Dividing the loader's `batch_size=` by the world size leaves every other read of the
same name at the global size: `torch.ones(batch_size, 1)` labels or `x.reshape(batch_size, -1)`
then disagree with the per-rank batch the loader yields. `batch_size_readers` finds those
reads and says whether the name can be rebound once, before the loader, to the per-rank
size so that every later read sees it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import Resolver, attr_path, bind_args, code, names_in, parameter_names
from fsdp2_retrofit.syntax.torch_api import (
    BATCH_SHAPE_FACTORIES, BATCH_SHAPE_METHODS, LEGACY_TENSORS, RANDOM_FACTORIES, TENSOR_FACTORIES,
)


@dataclass
class BatchSizeReaders:
    """The reads of a loader's batch size other than the loader's own argument.

    `shape`: reads in a training loop that size a tensor of one batch (a factory's or
    reshape's dimension): they want the per-rank size. `printed`: reads inside print(): either size is right.
    `other`: reads whose meaning the analysis cannot tell (a count of samples, an argument
    of some function), each with why. `problem`: why the name cannot be rebound once
    before the loader (node and why), or None.
    """

    key: str
    shape: List[cst.CSTNode] = field(default_factory=list)
    printed: List[cst.CSTNode] = field(default_factory=list)
    other: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)
    problem: Optional[Tuple[cst.CSTNode, str]] = None
    # the statement of the loader's block to rebind the name before, where a read sizes a batch tensor
    # above the loader (a label tensor preallocated before the DataLoader); None: just before the loader
    rebind_at: Optional[cst.CSTNode] = None


def batch_size_readers(resolver: Resolver, loader_stmt: cst.CSTNode, size: cst.BaseExpression,
                       loops: Sequence[cst.CSTNode]) -> Optional[BatchSizeReaders]:
    """The other reads of `size` (the loader's batch_size argument) when it is a plain
    name or attribute path (`batch_size`, `args.batch_size`); None for anything else.
    `loops`: the training loops; a tensor sized outside them counts as `shape` where it is not
    drawn at random and the name it is bound to is read in one of them (`label =
    torch.FloatTensor(opt.batchSize, 1)` before the loop, filled in each step); otherwise
    (samples drawn for a picture at the end of an epoch) it is not known to be part of a step,
    so it counts as `other`."""
    path = attr_path(size)
    if path is None:
        return None
    key = ".".join(path)
    scope = resolver.enclosing_function(loader_stmt)
    out = BatchSizeReaders(key)
    if len(path) == 1:
        home, bindings = name_home(resolver, path[0], scope)
        reads = [n for n in name_reads(resolver, path[0], home) if n is not size]
    else:
        home = name_home(resolver, path[0], scope)[0]
        bindings = [a for a in resolver.nodes(cst.Attribute) if attr_path(a) == path and is_target(resolver, a)]
        reads = [a for a in resolver.nodes(cst.Attribute)
                 if a is not size and attr_path(a) == path and not is_target(resolver, a)]
    for read in reads:
        if _sizes_a_batch_tensor(resolver, read):
            if any(loop in set(resolver.ancestors(read)) for loop in loops) or _step_buffer(resolver, read, loops):
                out.shape.append(read)
            else:
                out.other.append((read, "a tensor sized outside the training loop"))
        elif _printed(resolver, read):
            out.printed.append(read)
        else:
            out.other.append((read, _what_it_does(resolver, read)))
    if not out.shape:
        return out
    out.problem = _why_not_rebound(resolver, key, path, loader_stmt, scope, home, bindings, out)
    return out


def _why_not_rebound(resolver, key, path, loader_stmt, scope, home, bindings, out) -> Optional[Tuple[cst.CSTNode, str]]:
    if len(path) == 1 and home is not scope:
        where = "at module level" if home is None else f"in {home.name.value}()"
        return (bindings[0] if bindings else loader_stmt,
                f"`{key}` is bound {where} and the DataLoader is built in {_scope_name(scope)}(): "
                "rebinding it to the per-rank size there would make it a local name")
    if len(bindings) > 1:
        lines = ", ".join(str(resolver.line(b)) for b in bindings)
        return (bindings[1], f"`{key}` is bound {len(bindings)} times (lines {lines}): the rewrite cannot tell "
                             "which value each read sees once it is divided")
    for anc in resolver.ancestors(loader_stmt):
        if anc is scope:
            break
        if isinstance(anc, (cst.For, cst.While)):
            return (anc, f"the DataLoader is built inside a loop: `{key}` would be divided again on every pass")
    start = resolver.order(loader_stmt)
    block = resolver.block_of(loader_stmt)
    for read in sorted(out.shape, key=resolver.order):
        if resolver.enclosing_function(read) is scope and resolver.order(read) < start:
            anchor = next((a for a in resolver.ancestors(read) if resolver.block_of(a) is block
                           and isinstance(a, cst.BaseStatement)), None)
            if anchor is None or any(resolver.order(b) > resolver.order(anchor) for b in bindings):
                return (read, f"`{key}` sizes a batch tensor before the DataLoader is built, "
                              + ("outside the block that builds it" if anchor is None else "above its binding")
                              + ": that read would keep the global size")
            out.rebind_at = anchor  # the name is per-rank from the first batch tensor it sizes
            break
    if out.other:
        node, what = out.other[0]
        return (node, f"`{key}` is also read here ({what}): the rewrite cannot tell whether this read wants the "
                      "global batch size or the per-rank one")
    return None


def _scope_name(scope) -> str:
    return scope.name.value if scope is not None else "<module>"


def name_home(resolver: Resolver, name: str, scope) -> tuple:
    """The function (None: the module) whose binding of `name` the loader's scope reads,
    and that scope's binding nodes of it."""
    functions = [f for f in [scope, *[a for a in resolver.ancestors(scope) if isinstance(a, cst.FunctionDef)]]
                 if f is not None] if scope is not None else []
    for function in functions:
        found = _bindings_in(resolver, name, function)
        if found or name in parameter_names(function):
            return function, found
    return None, _bindings_in(resolver, name, None)


def _bindings_in(resolver: Resolver, name: str, function) -> List[cst.CSTNode]:
    """The nodes that bind `name` in `function`'s own scope (None: the module, with the
    functions that declare it `global`)."""
    found = []
    for node in resolver.nodes(cst.Name):
        if node.value != name or not is_target(resolver, node):
            continue
        owner = resolver.enclosing_function(node)
        if owner is function or (function is None and owner is not None and _declares_global(resolver, owner, name)):
            found.append(node)
    return found


def _declares_global(resolver: Resolver, function, name: str) -> bool:
    return any(any(n.name.value == name for n in g.names) for g in resolver.descendants(function, cst.Global))


def name_reads(resolver: Resolver, name: str, home) -> List[cst.Name]:
    """The reads of `name` that see `home`'s binding: in `home` and the functions inside
    it (the whole module for a global) that do not bind the name themselves."""
    out = []
    for node in resolver.nodes(cst.Name):
        if node.value != name or not _is_read(resolver, node):
            continue
        owner = resolver.enclosing_function(node)
        if home is not None and owner is not home and home not in set(resolver.ancestors(node)):
            continue
        if owner is not home and (_bindings_in(resolver, name, owner) or name in parameter_names(owner)):
            if not (home is None and _declares_global(resolver, owner, name)):
                continue
        out.append(node)
    return out


def _is_read(resolver: Resolver, node: cst.Name) -> bool:
    parent = resolver.parent(node)
    if isinstance(parent, cst.Attribute) and parent.attr is node:
        return False
    if isinstance(parent, cst.Arg) and parent.keyword is node:
        return False
    if isinstance(parent, (cst.Param, cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName)):
        return False
    if isinstance(parent, (cst.Global, cst.Nonlocal, cst.NameItem)):
        return False
    return not is_target(resolver, node)


def is_target(resolver: Resolver, node: cst.CSTNode) -> bool:
    """Whether `node` is (an element of) what an assignment, `for` or `with` binds."""
    child = node
    for anc in resolver.ancestors(node):
        if isinstance(anc, (cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
            child = anc
            continue
        if isinstance(anc, cst.AssignTarget):
            return anc.target is child
        if isinstance(anc, (cst.AugAssign, cst.AnnAssign)):
            return anc.target is child
        if isinstance(anc, (cst.For, cst.CompFor)):
            return anc.target is child
        if isinstance(anc, cst.NamedExpr):
            return anc.target is child
        if isinstance(anc, cst.AsName):
            return anc.name is child
        return False
    return False


def _sizes_a_batch_tensor(resolver: Resolver, node: cst.CSTNode) -> bool:
    """A dimension given to a tensor factory (`torch.ones(n, 1)`, `torch.randn((n, d))`)
    or to a reshape of a batch (`x.reshape(n, -1)`, `x.view(n, c, h, w)`)."""
    child = node
    for anc in resolver.ancestors(node):
        if isinstance(anc, (cst.Element, cst.Tuple, cst.List)):
            child = anc
            continue
        if isinstance(anc, cst.Arg) and anc.value is child:
            call = resolver.parent(anc)
            if not isinstance(call, cst.Call) or (anc.keyword is not None and anc.keyword.value not in ("size", "end")):
                return False
            if anc.keyword is not None and anc.keyword.value == "end" and not resolver.is_call_to(call, {"torch.arange"}):
                return False
            if resolver.is_call_to(call, BATCH_SHAPE_FACTORIES):
                # randint(low, high, size) and full(size, value): only a size tuple holds dimensions
                varargs = not resolver.qnames(call) & {"torch.randint", "torch.full"}
                return varargs or child is not node or anc.keyword is not None
            if resolver.is_call_to(call, LEGACY_TENSORS):  # FloatTensor(n, 1): sizes; FloatTensor([n]): data
                return child is node and anc.keyword is None
            if resolver.is_call_to(call, {"torch.arange"}):  # arange(n) or arange(end=n): n elements
                positional = [a for a in call.args if a.keyword is None]
                return (anc.keyword is not None and anc.keyword.value == "end" and not positional) or (
                    anc.keyword is None and len(positional) == 1 and child is node)
            func = call.func
            return isinstance(func, cst.Attribute) and func.attr.value in BATCH_SHAPE_METHODS and not (
                resolver.qnames(func) & BATCH_SHAPE_FACTORIES
            )
        return False
    return False


def _step_buffer(resolver: Resolver, node: cst.CSTNode, loops: Sequence[cst.CSTNode]) -> bool:
    """`node` sizes a tensor that is not drawn at random, bound to a name (`label = torch.ones(n, 1)`,
    `idx = torch.arange(n)`) that a training loop of the same function reads: a buffer of one batch."""
    call = next((a for a in resolver.ancestors(node) if isinstance(a, cst.Call)), None)
    if call is None or resolver.is_call_to(call, RANDOM_FACTORIES):
        return False
    value = call
    while isinstance(resolver.parent(value), (cst.Attribute, cst.Call)) and getattr(
            resolver.parent(value), "value" if isinstance(resolver.parent(value), cst.Attribute) else "func") is value:
        value = resolver.parent(value)  # torch.ones(n, 1).to(device)
    stmt = resolver.parent(value)
    if not isinstance(stmt, cst.Assign) or len(stmt.targets) != 1 or not isinstance(stmt.targets[0].target, cst.Name):
        return False
    name = stmt.targets[0].target.value
    function = resolver.enclosing_function(stmt)
    return any(n.value == name and not is_target(resolver, n) and resolver.enclosing_function(n) is function
               for loop in loops if resolver.enclosing_function(loop) is function
               for n in resolver.descendants(loop, cst.Name))


def _printed(resolver: Resolver, node: cst.CSTNode) -> bool:
    for anc in resolver.ancestors(node):
        if isinstance(anc, cst.Call) and "builtins.print" in resolver.qnames(anc):
            return True
        if isinstance(anc, cst.BaseStatement):
            return False
    return False


def _what_it_does(resolver: Resolver, node: cst.CSTNode) -> str:
    parent = resolver.parent(node)
    if isinstance(parent, cst.BinaryOperation):
        return f"arithmetic: `{code(parent)}`"
    if isinstance(parent, cst.Arg):
        call = resolver.parent(parent)
        if isinstance(call, cst.Call):
            return f"an argument of `{code(call.func)}(...)`"
    text = code(resolver.statement_of(node) or node).strip().splitlines()[0]
    return f"`{text}`"


# -- tensors shaped by the nominal batch size (check FSD120, and the data stage's report) --------------

PARTIAL_LAST_BATCH = ("but a rank's last batch is partial wherever its shard of the data does not divide by it "
                      "(the loader has no drop_last=True)")
# the factories whose arguments are sizes (torch.tensor(batch_size) holds the number)
_FACTORIES = {n for n in TENSOR_FACTORIES if n.rsplit(".", 1)[1] not in ("tensor", "as_tensor", "from_numpy")}
_SHAPERS = {"reshape", "view", "expand", "new_zeros", "new_ones", "new_full", "new_empty"}


def nominal_batch_size(call: cst.Call) -> Optional[Tuple[str, bool]]:
    """(the batch-size expression's code, whether it is divided) of a DataLoader(...) call."""
    value = None
    for i, arg in enumerate(call.args):
        if (arg.keyword is not None and arg.keyword.value == "batch_size") or (arg.keyword is None and i == 1):
            value = arg.value
    if value is None:
        return None
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.FloorDivide, cst.Divide)):
        value, divided = value.left, True
    else:
        divided = False
    if not isinstance(value, (cst.Name, cst.Attribute)):
        return None
    return code(value), divided


def drops_last(expr: Optional[cst.BaseExpression]) -> bool:
    """A loader's `drop_last=` is the literal True."""
    return isinstance(expr, cst.Name) and expr.value == "True"


def batch_shaped_calls(resolver: Resolver, loops: Sequence[cst.For], loader: str, name: str) -> List[cst.Call]:
    """The calls in the bodies of `loops` over `loader` (in the loop's own function) that shape a
    tensor by the expression `name` (a reshape/view/expand or a tensor factory given it as a dimension)."""
    out = []
    for loop in loops:
        if loader not in names_in(loop.iter):
            continue
        for call in resolver.descendants(loop.body, cst.Call):
            if resolver.enclosing_function(call) is resolver.enclosing_function(loop) and (
                    _shaped_by(resolver, call, name) or _shaped_inside(resolver, call, name)):
                out.append(call)
    return out


def _shaped_inside(resolver: Resolver, call: cst.Call, name: str) -> bool:
    """`hidden = model.init_hidden(args.batch_size)`: a function of the script, or the one method of
    that name among its classes, handed `name` as an argument whose parameter shapes a tensor there
    (`def init_hidden(self, bsz): return torch.zeros(self.layers, bsz, self.size)`)."""
    if not any(code(a.value) == name for a in call.args):
        return False
    func = call.func
    if type(func) is cst.Name:
        fns = [f for f in resolver.module.body if type(f) is cst.FunctionDef and f.name.value == func.value]
        skip = 0
    elif type(func) is cst.Attribute:
        fns = [m for c in resolver.module.body if type(c) is cst.ClassDef for m in c.body.body
               if type(m) is cst.FunctionDef and m.name.value == func.attr.value]
        skip = 1
    else:
        return False
    if len(fns) != 1:
        return False
    fn = fns[0]
    params = [p for p, arg in bind_args(fn, call, skip) if code(arg) == name]
    return any(resolver.enclosing_function(c) is fn and _shaped_by(resolver, c, p)
               for p in params for c in resolver.descendants(fn, cst.Call))


def shaped_in_scope(resolver: Resolver, node: cst.CSTNode, name: str) -> List[cst.Call]:
    """The calls of the function around `node` (or of the module's own code) that shape a tensor
    by the expression `name`, as batch_shaped_calls does for a loop."""
    fn = resolver.enclosing_function(node)
    scope = fn if fn is not None else resolver.module
    return [call for call in resolver.descendants(scope, cst.Call)
            if resolver.enclosing_function(call) is fn and _shaped_by(resolver, call, name)]


def _shaped_by(resolver: Resolver, call: cst.Call, name: str) -> bool:
    func = call.func
    shaper = isinstance(func, cst.Attribute) and func.attr.value in _SHAPERS
    if not shaper and not (resolver.qnames(call) & _FACTORIES):
        return False
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value not in ("size",):
            continue
        values = [e.value for e in arg.value.elements] if isinstance(arg.value, (cst.Tuple, cst.List)) else [arg.value]
        if any(code(v) == name for v in values):
            return True
    return False


def short_code(node: cst.CSTNode) -> str:
    text = code(node)
    return text if len(text) <= 60 else text[:57] + "..."
