"""Where rank 0's value of a name bound under a rank-0 `if` can be handed to every rank.

A save the rewrite runs on every rank (a DCP save) reads `run_dir`, bound under `if rank == 0:`
(analysis/checkpoints.rank_zero_names). Right after that `if` (or after init_process_group, where
the group starts later), every rank runs

    run_dir_shared = [run_dir] if rank == 0 else [None]
    dist.broadcast_object_list(run_dir_shared, src=0)
    run_dir = run_dir_shared[0]

That is safe where every rank reaches the `if` together (no `if` around it that some ranks may skip,
followed by value: analysis/rank_uniform.py), its test can be evaluated again on every rank (a rank
test and conditions every rank shares, no call), the name's reader comes after it, and the other
ranks, where they bind the name to a value of their own (`run_dir = None` before the `if`, or in its
`else`), read it nowhere but where the save does (that value is replaced). In a function or at module
level, wherever the `if` sits in its block. Anything else: the reason, for the refusal (FSR704)."""
from __future__ import annotations

from typing import Optional, Tuple

import libcst as cst

from .checkpoints import rank_gate, split_rank_test
from .rank_bindings import RankZeroRead
from .rank_uniform import RankUniform, ranks_part_at
from .rank_values import rank_aliases
from fsdp2_retrofit.syntax.names import assigned_names, code, names_read, walk


def broadcast_anchor(read: RankZeroRead, facts) -> Tuple[Optional[cst.CSTNode], str, str]:
    """(the statement the broadcast goes after, the test that is true on rank 0 there, "") or
    (None, "", why it cannot go anywhere)."""
    r = facts.resolver
    gate, reader = read.gate, read.reader
    line = r.line
    function = r.enclosing_function(gate)
    rank, other = split_rank_test(gate.test, rank_aliases(gate, facts))
    if not rank:
        return None, "", f"`{code(gate.test)}` is no plain rank-0 test (a rank test under `or` or `not`)"
    uniform = RankUniform(r, {l.name for l in facts.loaders}, facts=facts)
    for part in other:
        if not uniform.condition(part, gate) or any(type(n) is cst.Call for n in walk(part)):
            return None, "", (f"`{code(part)}`, the `if`'s other condition, is not a plain value every rank shares: "
                          "the broadcast evaluates the test again on every rank")
    if r.order(reader) < r.order(gate):
        return None, "", f"line {line(reader)} reads it before the `if`"
    around = ranks_part_at(gate, function, r, uniform)
    if around is not None:
        return None, "", (f"the `if` is inside `{_head(around)}` (line {line(around)}), which some ranks may skip: "
                      "the broadcast there would wait for them")
    if read.otherwise is not None:
        used = _read_by_other_ranks(read, facts)
        if used is not None:
            return None, "", (f"the other ranks bind it to a value of their own (line {line(read.otherwise)}) and read "
                          f"that value on line {line(used)}, which rank 0's would replace")
    anchor, test = gate, code(gate.test)
    body = list(function.body.body) if function is not None else list(facts.module.body)
    # bound on every rank before the `if`'s statement (`run_dir = None`): rank 0 holds its value
    # wherever after it, whatever the `if` decided; the broadcast asks the rank alone
    default = read.otherwise is not None and read.otherwise in body and r.order(read.otherwise) < r.order(gate)
    if default:
        test = " and ".join(code(part) for part in rank)
    init = facts.distributed_init
    if init is not None and r.order(init) > r.order(gate):
        tops = [next((a for a in [n, *r.ancestors(n)] if a in body), None) for n in (gate, init, reader)]
        gate_top, init_top, reader_top = tops
        if (gate_top is not gate and not default) or init_top is None or reader_top is None \
                or body.index(init_top) > body.index(reader_top):
            return None, "", (f"the process group starts after it (line {line(init)}), and the broadcast cannot "
                              "wait for it before the name is read")
        anchor = init_top
    return anchor, test, ""


def _read_by_other_ranks(read: RankZeroRead, facts) -> Optional[cst.CSTNode]:
    """A statement other than the save's reader that reads the name on the ranks other than 0 (outside
    every rank-0 `if`), in the name's scope; None when there is none."""
    r = facts.resolver
    scope = r.enclosing_function(read.gate)
    for node in r.nodes(cst.Name):
        if node.value != read.name or r.enclosing_function(node) is not scope:
            continue
        stmt = r.statement_of(node)
        if stmt is None or stmt is read.reader or rank_gate(stmt, facts) is not None:
            continue
        if isinstance(stmt, cst.SimpleStatementLine) and read.name in assigned_names(stmt) \
                and read.name not in _value_names(stmt):
            continue  # a binding (`run_dir = None`), not a read
        if stmt is read.gate:
            continue
        return stmt
    return None


def _value_names(stmt: cst.SimpleStatementLine) -> set:
    """Names the values of a statement's assignments read."""
    found = set()
    for small in stmt.body:
        value = getattr(small, "value", None)
        if value is not None:
            found |= names_read(value)
    return found


def _head(stmt) -> str:
    if type(stmt) is cst.If:
        return f"if {code(stmt.test)}"
    if type(stmt) is cst.Try:
        return "try: ... except"
    return code(stmt).splitlines()[0].rstrip(":")
