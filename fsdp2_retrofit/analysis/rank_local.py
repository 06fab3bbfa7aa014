"""Rank-local values that name shared things: a run folder named from the clock.

`run_dir = os.path.join(args.runs, time.strftime("%Y%m%d-%H%M%S"))` gives each process its
own name (the ranks do not start in the same second, nor the same microsecond for
`time.time()`; `uuid.uuid4()` differs always). Where that value reaches a path every rank
uses (a checkpoint save, now a collective DCP save into one folder; `os.makedirs`; a file
opened for writing; a log writer), each rank writes somewhere else: a checkpoint split over
folders, one log folder per rank.

Found by value, from the sinks back (analysis/flow.py): the origins of a sink's path
argument are followed into the arguments of calls the analysis does not see into
(`os.path.join(...)`, `str(...)`, `.format(...)`), f-strings, `+`/`%`, attributes and
subscripts, down to a call of a clock or id source. A `t0 = time.time()` that reaches
no sink (an elapsed-time print) is never one. Each source is reported with the statement
that binds it: a plain `name = ...` or `obj.attr = ...` that every rank runs (rank 0's
value can be broadcast right after it), a `return` of a function of the script (its
callers' bindings are), or anything else (the value cannot be handed over by name).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import attr_path, code
from fsdp2_retrofit.syntax.torch_api import BROADCAST_OBJECT_LIST, TORCH_PATH_WRITERS

# calls whose value differs between processes started together
CLOCKS = frozenset({
    "time.time", "time.time_ns", "time.strftime", "time.localtime", "time.gmtime", "time.ctime", "time.asctime",
    "datetime.datetime.now", "datetime.datetime.today", "datetime.datetime.utcnow", "datetime.date.today",
})
# (not `os.getpid()` nor `tempfile.mkdtemp()`: a path made from those is usually meant to be
# the process's own, a scratch folder or a per-process log)
IDS = frozenset({"uuid.uuid1", "uuid.uuid4", "secrets.token_hex", "secrets.token_urlsafe"})
# these take the moment as an optional argument: with one given, that argument is the source
_TIME_ARGUMENT = {"time.strftime": 1, "time.localtime": 0, "time.gmtime": 0, "time.ctime": 0, "time.asctime": 0}

# calls whose arguments name a path every rank that runs them writes or creates
_PATH_SINKS = TORCH_PATH_WRITERS | frozenset({
    "os.makedirs", "os.mkdir", "builtins.open", "open", "tensorboardX.SummaryWriter", "logging.FileHandler",
    "shutil.copy", "shutil.copyfile", "shutil.copytree", "numpy.save", "numpy.savez", "safetensors.torch.save_file",
})
# `path.mkdir()`, `path.write_text(...)`: the receiver is the path
_PATH_METHODS = frozenset({"mkdir", "write_text", "write_bytes", "touch", "save_pretrained"})
_MAX_DEPTH = 12


@dataclass
class RankLocalName:
    """A value each rank computes for itself that reaches a path every rank uses."""

    source: cst.Call  # `time.strftime(...)`
    what: str  # "the clock" / "a random id"
    binding: Optional[cst.SimpleStatementLine]  # `run_dir = ...`: broadcast rank 0's value right after it
    target: Optional[cst.BaseExpression]  # the name or `obj.attr` it binds
    sinks: List[cst.Call] = field(default_factory=list)  # the calls it reaches
    lost: str = ""  # why it cannot be handed over by name (binding is None)


def rank_local_names(facts) -> List[RankLocalName]:
    """Each binding of a clock/id value that reaches a path some statement uses on every
    rank (not under a rank-0 `if`); one record a binding, its sinks listed."""
    from .checkpoints import rank_gate

    r = facts.resolver
    flow = facts.analysis.flow
    found: Dict[int, RankLocalName] = {}
    for call in r.nodes(cst.Call):
        args = _sink_arguments(call, r)
        if not args or rank_gate(call, facts) is not None:
            continue
        sources: Set[int] = set()
        calls: List[cst.Call] = []
        for arg in args:
            for source in _sources(arg, flow, r, set(), 0):
                if id(source) not in sources:
                    sources.add(id(source))
                    calls.append(source)
        for source in calls:
            for record in _bindings(source, facts, flow):
                key = id(record.binding) if record.binding is not None else id(record.source)
                kept = found.setdefault(key, record)
                if call not in kept.sinks:
                    kept.sinks.append(call)
    order = {id(s): i for i, s in enumerate(r.nodes(cst.Call))}
    return sorted(found.values(), key=lambda rec: order.get(id(rec.source), 0))


def source_kind(call: cst.Call, r) -> Optional[str]:
    """"the clock" or "a random id" for a call of such a source (a
    clock function handed its moment is not one: the moment is), else None."""
    for name in r.qnames(call):
        if name in CLOCKS:
            at = _TIME_ARGUMENT.get(name)
            if at is not None and len(call.args) > at:
                return None
            return "the clock"
        if name in IDS:
            return "a random id"
    return None


def _sink_arguments(call: cst.Call, r) -> List[cst.BaseExpression]:
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value in _PATH_METHODS:
        return [func.value] + [a.value for a in call.args if a.keyword is None][:1]
    if not r.qnames(call) & _PATH_SINKS:
        return []
    out = [a.value for a in call.args if a.keyword is None or a.keyword.value in (
        "f", "path", "checkpoint_id", "log_dir", "logdir", "filename", "name", "dst", "file")]
    if r.is_call_to(call, {"builtins.open", "open"}):
        out = out[:1]  # the path, not the mode
    return out


def _sources(expr, flow, r, seen: Set[int], depth: int):
    """The clock/id calls whose value `expr` can be built from."""
    if depth > _MAX_DEPTH or id(expr) in seen:
        return
    seen.add(id(expr))
    for origin in flow.values(expr):
        node = origin[0] if isinstance(origin, tuple) else origin
        yield from _origin_sources(node, flow, r, seen, depth + 1)


def _origin_sources(node, flow, r, seen, depth):
    if isinstance(node, cst.Call):
        if source_kind(node, r):
            yield node
            return
        parts = [a.value for a in node.args]
        if isinstance(node.func, cst.Attribute):
            parts.append(node.func.value)  # `datetime.now().strftime(...)`, `"{}".format(...)`
    elif isinstance(node, cst.FormattedString):
        parts = [p.expression for p in node.parts if isinstance(p, cst.FormattedStringExpression)]
    elif isinstance(node, cst.ConcatenatedString):
        parts = [node.left, node.right]
    elif isinstance(node, cst.BinaryOperation):
        parts = [node.left, node.right]
    elif isinstance(node, (cst.Attribute, cst.Subscript)):
        parts = [node.value]  # `uuid.uuid4().hex`, `str(uuid.uuid4())[:8]`
        parts += _attribute_stores(node, r)  # `args.out = f"runs/{uuid.uuid4()}"`
    elif isinstance(node, (cst.Tuple, cst.List)):
        parts = [e.value for e in node.elements]
    else:
        return
    for part in parts:
        if part is not node:
            yield from _sources(part, flow, r, seen, depth)


def _attribute_stores(node, r) -> list:
    """The values `obj.attr = value` statements of the same function give `obj.attr` (an
    argparse namespace or config object the value flow does not follow)."""
    path = attr_path(node) if isinstance(node, cst.Attribute) else None
    if not path or len(path) != 2 or path[0] == "self":
        return []
    fn = r.enclosing_function(node)
    scope = fn if fn is not None else r.module
    return [a.value for a in r.descendants(scope, cst.Assign)
            if r.enclosing_function(a) is fn and any(attr_path(t.target) == path for t in a.targets)]


def _bindings(source: cst.Call, facts, flow) -> List[RankLocalName]:
    """Where rank 0's value of `source` can be handed to the other ranks."""
    r = facts.resolver
    what = source_kind(source, r) or "the clock"
    stmt = r.statement_of(source)
    small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
    if isinstance(small, cst.Assign) and len(small.targets) == 1 and _nameable(small.targets[0].target):
        return [RankLocalName(source, what, stmt, small.targets[0].target)]
    if isinstance(small, cst.AnnAssign) and small.value is not None and _nameable(small.target):
        return [RankLocalName(source, what, stmt, small.target)]
    if isinstance(small, cst.Return) and small.value is not None:
        fn = r.enclosing_function(small)
        callers = [call for call, _ in flow.bound_calls(fn)] if fn is not None else []
        out = []
        for call in callers:
            caller = r.statement_of(call)
            inner = caller.body[0] if isinstance(caller, cst.SimpleStatementLine) and len(caller.body) == 1 else None
            if isinstance(inner, cst.Assign) and inner.value is call and len(inner.targets) == 1 and \
                    _nameable(inner.targets[0].target):
                out.append(RankLocalName(source, what, caller, inner.targets[0].target))
            else:
                return [RankLocalName(source, what, None, None, lost=(
                    f"`{fn.name.value}(...)` returns it and `{code(call)}` hands it on unnamed"))]
        if out:
            return out
        return [RankLocalName(source, what, None, None, lost=f"`{fn.name.value if fn else '?'}(...)` returns it")]
    where = f"`{code(stmt).strip().splitlines()[0]}`" if stmt is not None else "an expression"
    return [RankLocalName(source, what, None, None, lost=f"{where} uses it without naming it")]


def _nameable(target) -> bool:
    """`name` or `obj.attr` (`args.run_dir`): a target rank 0's value can be assigned back to."""
    path = attr_path(target)
    return bool(path) and len(path) <= 2 and (len(path) == 1 or path[0] != "self")


def every_rank_binds(record: RankLocalName, facts) -> bool:
    """The binding runs on every rank: it is under no rank-0 `if`, nor is any call of the
    function that holds it (`if rank == 0: run_dir = make_run_dir()`: the checkpoint stage
    hands such a name over where a save reads it)."""
    from .checkpoints import rank_gate

    if record.binding is None or rank_gate(record.binding, facts) is not None or shared_already(record, facts):
        return False
    fn = facts.resolver.enclosing_function(record.binding)
    if fn is None:
        return True
    return not any(rank_gate(call, facts) is not None for call, _ in facts.analysis.flow.bound_calls(fn))


def shared_already(record: RankLocalName, facts) -> bool:
    """A `dist.broadcast_object_list(box, src=0)` after the binding, in its block, hands
    the bound value over: `box` holds a list of it (`box = [run_dir]`)."""
    r = facts.resolver
    block = r.block_of(record.binding)
    body = list(getattr(block, "body", ()))
    if record.binding not in body:
        return False
    target = attr_path(record.target)
    for stmt in body[body.index(record.binding) + 1:]:
        for call in r.descendants(stmt, cst.Call):
            if not r.is_call_to(call, BROADCAST_OBJECT_LIST) or not call.args:
                continue
            for origin in facts.analysis.flow.values(call.args[0].value):
                if isinstance(origin, cst.List) and any(
                    isinstance(e, cst.Element) and attr_path(e.value) == target for e in origin.elements
                ):
                    return True
    return False
