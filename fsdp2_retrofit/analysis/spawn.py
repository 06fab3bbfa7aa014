"""`mp.spawn(worker, args=(...), nprocs=N)` launchers: the worker function, what the
spawn hands it, and how the worker starts its process group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import bind_args, code
from fsdp2_retrofit.syntax.torch_api import INIT_PROCESS_GROUP as INIT, SPAWN

# objects that only exist in the launching process: a torchrun worker cannot receive them
PROCESS_OBJECTS = ("Queue", "SimpleQueue", "JoinableQueue", "Manager", "Pipe", "Event", "Lock", "Barrier",
                   "Value", "Array", "Semaphore", "Condition")
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT")


@dataclass
class SpawnSite:
    call: cst.Call
    stmt: cst.CSTNode
    worker: Optional[cst.FunctionDef]
    args: Optional[List[cst.BaseExpression]]  # the `args=(...)` elements; None when not a tuple literal
    nprocs: Optional[cst.BaseExpression]
    other_kwargs: List[str] = field(default_factory=list)
    init: Optional[cst.Call] = None  # init_process_group inside the worker, or in a function it calls
    # where `init` is in a set-up function the worker calls (`ddp_setup(rank, world_size)`): each
    # parameter of the functions on the way, bound to what the worker's call hands it
    setup_args: Dict[str, cst.BaseExpression] = field(default_factory=dict)
    # `os.environ["MASTER_ADDR"] = ...` statements anywhere in the script
    rendezvous: List[cst.SimpleStatementLine] = field(default_factory=list)
    process_objects: List[cst.BaseExpression] = field(default_factory=list)


def spawns(facts) -> List[SpawnSite]:
    r = facts.resolver
    out = []
    functions = {f.name.value: f for f in facts.module.body if isinstance(f, cst.FunctionDef)}
    for call in r.nodes(cst.Call):
        if not r.is_call_to(call, SPAWN):
            continue
        positional = [a.value for a in call.args if a.keyword is None and not a.star]
        kw = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        fn = positional[0] if positional else kw.get("fn")
        args = kw.get("args", positional[1] if len(positional) > 1 else None)
        nprocs = kw.get("nprocs", positional[2] if len(positional) > 2 else None)
        worker = functions.get(fn.value) if isinstance(fn, cst.Name) else None
        elements = None
        if args is None:
            elements = []
        elif isinstance(args, cst.Tuple):
            elements = [e.value for e in args.elements if not isinstance(e, cst.StarredElement)]
            if len(elements) != len(args.elements):
                elements = None
        site = SpawnSite(
            call=call,
            stmt=r.statement_of(call),
            worker=worker,
            args=elements,
            nprocs=nprocs,
            other_kwargs=[k for k, v in kw.items() if k not in ("fn", "args", "nprocs")
                          and not (k == "join" and code(v) == "True")],
        )
        if worker is not None:
            site.init, site.setup_args = _process_group_start(r, worker, functions)
        site.rendezvous = [s for s in r.nodes(cst.SimpleStatementLine) if _sets_rendezvous(s)]
        site.process_objects = [e for e in elements or [] if _is_process_object(e, facts)]
        out.append(site)
    return out


def _process_group_start(r, worker, functions, depth: int = 3):
    """The init_process_group call the worker makes: in its own body, or in a top-level function
    it calls (a set-up helper of the script or, linked, of a sibling module), up to `depth` calls
    down; with the helper parameters on the way bound to the expressions the worker hands them."""
    own = [c for c in r.nodes(cst.Call) if r.enclosing_function(c) is worker]
    init = next((c for c in own if r.is_call_to(c, INIT)), None)
    if init is not None or depth == 0:
        return init, {}
    for call in own:
        helper = functions.get(call.func.value) if isinstance(call.func, cst.Name) else None
        if helper is None or helper is worker:
            continue
        init, inner = _process_group_start(r, helper, functions, depth - 1)
        if init is None:
            continue
        if any(a.star for a in call.args):
            return None, {}  # what *args hands the helper is not read
        bound = dict(bind_args(helper, call))
        # a name the helper hands on is what the worker handed the helper
        inner = {k: bound.get(v.value, v) if isinstance(v, cst.Name) else v for k, v in inner.items()}
        return init, {**bound, **inner}
    return None, {}


def in_worker(site: SpawnSite, expr: cst.BaseExpression) -> cst.BaseExpression:
    """An argument of init_process_group as the worker writes it (a helper's parameter is what the
    worker's call hands that helper)."""
    if isinstance(expr, cst.Name) and expr.value in site.setup_args:
        return site.setup_args[expr.value]
    return expr


def _sets_rendezvous(stmt) -> bool:
    if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign) or len(stmt.body[0].targets) != 1:
        return False
    target = stmt.body[0].targets[0].target
    return (
        isinstance(target, cst.Subscript)
        and "environ" in code(target.value)
        and any(f'"{k}"' in code(target) or f"'{k}'" in code(target) for k in RENDEZVOUS_ENV)
    )


def _is_process_object(expr, facts) -> bool:
    """A queue, manager, pipe... built in the launcher (directly or through a name bound from one)."""
    r = facts.resolver
    values = [expr]
    if isinstance(expr, cst.Name):
        fn = r.enclosing_function(expr)
        for stmt in r.nodes(cst.SimpleStatementLine):
            if r.enclosing_function(stmt) is not fn or len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            if any(isinstance(t.target, cst.Name) and t.target.value == expr.value for t in stmt.body[0].targets):
                values.append(stmt.body[0].value)
    for value in values:
        text = code(value)
        if isinstance(value, cst.Call) and any(f"{name}(" in text for name in PROCESS_OBJECTS):
            return True
    return False
