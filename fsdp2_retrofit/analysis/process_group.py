"""The process group a script starts itself (`dist.init_process_group(...)` under
torchrun): where it starts, relative to the model, and the names the script keeps
for its local rank, rank and world size.

The launch stage reuses such a group instead of starting a second one; rank-0
gating and the sampler use the script's own names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import calls_in, code
from fsdp2_retrofit.syntax.rank import is_rank_value, is_world_size_value  # noqa: F401  (is_rank_value: kept importable here)
from fsdp2_retrofit.syntax.torch_api import DEVICE_SELECTORS as SET_DEVICE
from fsdp2_retrofit.syntax.torch_api import DESTROY_PROCESS_GROUP as DESTROY


@dataclass
class ProcessGroup:
    init: cst.Call
    init_stmt: cst.CSTNode  # the statement holding the call, in its own block
    # the statement of the entry block after which the group exists (the init itself,
    # or the call of the set-up function that starts it); None when it starts before
    # the entry block runs (module level, above `main()`)
    start: Optional[cst.CSTNode]
    # the compound statement of the entry block the init sits in (`if ddp:`), if any
    conditional: Optional[cst.CSTNode]
    set_device: List[cst.Call] = field(default_factory=list)
    local_rank_name: Optional[str] = None  # bound from LOCAL_RANK in the init's scope, before it
    world_size_name: Optional[str] = None  # bound in the entry scope
    destroys: List[cst.Call] = field(default_factory=list)


def process_group(facts) -> Optional[ProcessGroup]:
    """The script's own process group, or None when it starts none."""
    if facts.distributed_init is None:
        return None
    r = facts.resolver
    init = facts.distributed_init
    init_stmt = r.statement_of(init)
    start, conditional = _start(init_stmt, facts)
    init_fn = r.enclosing_function(init)
    calls = r.nodes(cst.Call)
    return ProcessGroup(
        init=init,
        init_stmt=init_stmt,
        start=start,
        conditional=conditional,
        set_device=[c for c in calls if r.is_call_to(c, SET_DEVICE)],
        local_rank_name=_bound_from(facts, init_fn, _local_rank_number, before=init),
        world_size_name=world_size_name(facts),
        destroys=[c for c in calls if r.is_call_to(c, DESTROY)],
    )


def _start(init_stmt, facts):
    """(the entry-block statement after which the group exists, the compound
    statement of the entry block around the init)."""
    r = facts.resolver
    block = facts.entry_block
    body = list(block.body)
    node = init_stmt
    while node is not None and node not in body:
        node = r.parent(node)
    if node is not None:
        return node, (node if node is not init_stmt else None)
    # started in a set-up function that the entry block calls
    init_fn = r.enclosing_function(init_stmt)
    if init_fn is not None:
        for stmt in body:
            for call in calls_in(stmt):
                if isinstance(call.func, cst.Name) and call.func.value == init_fn.name.value:
                    return stmt, None
    return None, None


def _local_rank_number(value) -> bool:
    """`int(os.environ["LOCAL_RANK"])`, `int(env["LOCAL_RANK"])`, `int(os.getenv("LOCAL_RANK", 0))`: a number
    read from LOCAL_RANK (not a dict of the environment whose keys name it)."""
    return (type(value) is cst.Call and type(value.func) is cst.Name and value.func.value == "int"
            and len(value.args) == 1 and "LOCAL_RANK" in code(value.args[0].value))


def _bound_from(facts, function, test, before=None) -> Optional[str]:
    """A name assigned in `function` (module level for None) from a value passing `test`."""
    r = facts.resolver
    limit = r.order(before) if before is not None else None
    for stmt in r.nodes(cst.SimpleStatementLine):
        if r.enclosing_function(stmt) is not function or (limit is not None and r.order(stmt) > limit):
            continue
        for target, value in _pairs(stmt):
            if isinstance(target, cst.Name) and value is not None and test(value):
                return target.value
    return None


def _pairs(stmt):
    """(target, value) of a one-target assignment, element-wise for `a, b = x, y`."""
    if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign) or len(stmt.body[0].targets) != 1:
        return []
    target, value = stmt.body[0].targets[0].target, stmt.body[0].value
    if isinstance(target, cst.Tuple) and isinstance(value, cst.Tuple) and len(target.elements) == len(value.elements):
        return [(t.value, v.value) for t, v in zip(target.elements, value.elements)]
    return [(target, value)]


def world_size_name(facts) -> Optional[str]:
    scope = facts.entry_scope if isinstance(facts.entry_scope, cst.FunctionDef) else None
    return _bound_from(facts, scope, lambda v: is_world_size_value(v, facts.resolver))
