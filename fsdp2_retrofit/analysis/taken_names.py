"""Names the rewrite's own lines spell, already bound by the script to something else.

Every line the stages write calls torch.distributed through the name `dist`
(`dist.init_process_group`, `dist.get_rank()`, `dist.barrier()`) and imports it as
`import torch.distributed as dist`. A script that binds `dist` to another value
(`import torch.distributions as dist`, the probability distributions, or
`dist = ...`) would have the two imports rebind each other: whichever comes last
wins, and either the process group or the script's own `dist.Categorical` raises
AttributeError at run time. The launch stage refuses such a script at the binding.
"""
from __future__ import annotations

from typing import Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import _module_bindings, import_bindings

# (the name the rewrite's lines use, the module they mean by it)
RESERVED = (("dist", "torch.distributed"),)


def foreign_binding(resolver) -> Optional[Tuple[cst.CSTNode, str, str, str]]:
    """(the node, the name, what the script binds it to, the module the rewrite needs there)
    of the first binding of a reserved name to something else; None when there is none.
    Imports anywhere in the file count (a local import shadows the rewrite's inside its
    function); other bindings count at the module's top level (inside top-level
    if/for/with/try too), where the rewrite's module-level import lives."""
    wanted = dict(RESERVED)
    found = []
    for kind in (cst.Import, cst.ImportFrom):
        for imp in resolver.nodes(kind):
            for name, qualified in import_bindings(imp):
                if name in wanted and qualified != wanted[name]:
                    found.append((imp, name, f"`{qualified}`"))
    for stmt in resolver.module.body:
        if _is_import_line(stmt):
            continue  # counted above, with what it imports
        for name in set(_module_bindings((stmt,))) & set(wanted):
            found.append((stmt, name, "a value of its own" + _assigned(stmt)))
    if not found:
        return None
    node, name, what = min(found, key=lambda f: resolver.order(f[0]))
    return node, name, what, wanted[name]


def _is_import_line(stmt) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in stmt.body
    )


def _assigned(stmt) -> str:
    """` (\\`name = value\\`)` for a one-line assignment, else ""."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        small = stmt.body[0]
        if len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
            value = cst.Module(body=[]).code_for_node(small.value)
            if len(value) <= 40:
                return f" (`{small.targets[0].target.value} = {value}`)"
    return ""

