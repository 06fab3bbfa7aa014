"""Initialisation statements, and the resume-or-initialise `if` after a build.

A script that resumes or initialises after building its models,

    if opt.epoch != 0:
        G.load_state_dict(torch.load(path))
    else:
        G.apply(weights_init)

cannot have its fully_shard before that `if` (the apply would draw each rank's
shards on its own: not the single-process weights) nor after it (the load of a
DCP checkpoint needs the sharded model). Such an `if` splits into two with the
same test: the initialising branch first, on the whole modules, then fully_shard,
then the loading branch (codemods/resume_init.py). It splits only when that is
the same program: the test reads no call (it is evaluated twice, with nothing but
the initialisation, which assigns no name, between the two) and the initialising
branch holds initialisation calls only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import walk

# nodes whose evaluation can do something, or differ between two evaluations
_IMPURE = (cst.Call, cst.NamedExpr, cst.Await, cst.Yield, cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp,
           cst.GeneratorExp)


def _rooted_name(expr) -> Optional[str]:
    """`model` for `model`, `model.a.b`, `model.blocks[0].c`."""
    while isinstance(expr, (cst.Attribute, cst.Subscript)):
        expr = expr.value
    return expr.value if isinstance(expr, cst.Name) else None


def _dotted(expr) -> Optional[List[str]]:
    parts = []
    while isinstance(expr, cst.Attribute):
        parts.append(expr.attr.value)
        expr = expr.value
    if not isinstance(expr, cst.Name):
        return None
    parts.append(expr.value)
    return parts[::-1]


def initialised_name(call: cst.BaseExpression) -> Optional[str]:
    """The model an initialisation call draws or sets weights of: `model.apply(fn)`
    (model), `nn.init.normal_(model.fc.weight, ...)` / `init.zeros_(model.b)`
    (model); None for any other expression."""
    if not isinstance(call, cst.Call):
        return None
    func = call.func
    if (isinstance(func, cst.Attribute) and func.attr.value == "apply" and isinstance(func.value, cst.Name)
            and len(call.args) == 1 and call.args[0].keyword is None and not call.args[0].star):
        return func.value.value
    path = _dotted(func)
    if (path and len(path) >= 2 and path[-2] == "init" and path[-1].endswith("_") and path[0] in ("torch", "nn", "init")
            and call.args and call.args[0].keyword is None and not call.args[0].star):
        return _rooted_name(call.args[0].value)
    return None


def initialised_names(stmt) -> Optional[set]:
    """The models a statement of initialisation calls only initialises (None if it
    holds anything else)."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return None
    names = set()
    for small in stmt.body:
        name = initialised_name(small.value) if isinstance(small, cst.Expr) else None
        if name is None:
            return None
        names.add(name)
    return names


def branch_initialises(block) -> Optional[set]:
    """The models a block (an `if` body) of initialisation statements only initialises."""
    body = list(block.body) if isinstance(block, cst.IndentedBlock) else [block]
    names = set()
    for stmt in body:
        found = initialised_names(stmt)
        if found is None:
            return None
        names |= found
    return names or None


def pure_test(test: cst.BaseExpression) -> bool:
    """A test that calls nothing: two evaluations with no assignment between agree."""
    return not any(isinstance(node, _IMPURE) for node in walk(test))


@dataclass
class InitBranch:
    """`if test: A else: B` whose branch `init` (A or B) only initialises models."""

    stmt: cst.If
    init_in_else: bool  # B initialises, A loads (`if resume: load else: init`)
    models: set

    @property
    def init_block(self):
        return self.stmt.orelse.body if self.init_in_else else self.stmt.body

    @property
    def other_block(self):
        return self.stmt.body if self.init_in_else else self.stmt.orelse.body


def init_branch(stmt) -> Optional[InitBranch]:
    """`stmt` as an if/else that can split into its initialising branch and the other
    (see the module's docstring), or None."""
    if not (isinstance(stmt, cst.If) and isinstance(stmt.orelse, cst.Else) and pure_test(stmt.test)):
        return None
    in_else = branch_initialises(stmt.orelse.body)
    in_body = branch_initialises(stmt.body)
    if in_else and not in_body:
        return InitBranch(stmt, True, in_else)
    if in_body and not in_else:
        return InitBranch(stmt, False, in_body)
    return None
