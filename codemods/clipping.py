"""clipping: read the gradient norm that clip_grad_norm_ returns as one global value."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.syntax.names import assigned_names, names_in
from fsdp2_retrofit.syntax.torch_api import CLIP_GRAD_NORM as CLIP
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

NUMBER_METHODS = {"item", "tolist", "cpu", "numpy"}
NUMBER_FUNCTIONS = {"float", "int", "round"}


class ReadGlobalGradNormCommand(RetrofitStage):
    DESCRIPTION = "After `norm = clip_grad_norm_(...)`, make `norm` a plain tensor with .full_tensor() on every rank."
    CODE = "clipping"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        for call in facts.resolver.nodes(cst.Call):
            if not facts.resolver.is_call_to(call, CLIP):
                continue
            parent = facts.resolver.parent(call)
            read = (
                isinstance(parent, cst.Attribute) and parent.value is call and parent.attr.value in NUMBER_METHODS
            ) or (
                isinstance(parent, cst.Arg)
                and isinstance(facts.resolver.parent(parent), cst.Call)
                and isinstance(facts.resolver.parent(parent).func, cst.Name)
                and facts.resolver.parent(parent).func.value in NUMBER_FUNCTIONS
            )
            if read:
                editor.replace_expression(call, lambda updated: cst.Call(cst.Attribute(updated, cst.Name("full_tensor"))))
                self.change(
                    call,
                    "the norm clip_grad_norm_ returns is read with .full_tensor() first",
                    "with sharded parameters the norm is a DTensor; full_tensor() gives every rank the global norm",
                    "a local read differs per rank",
                )
        for stmt in facts.resolver.nodes(cst.SimpleStatementLine):
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            value = stmt.body[0].value
            names = assigned_names(stmt)
            if not facts.resolver.is_call_to(value, CLIP) or len(names) != 1:
                continue
            name = next(iter(names))
            following = _following(stmt, facts)
            if following is not None and code(following) == f"{name} = {name}.full_tensor()":
                continue  # already converted
            if not _read_later(name, stmt, facts):
                continue
            editor.insert_after(stmt, [self.stmt(f"{name} = {name}.full_tensor()\n")])
            self.change(
                stmt,
                f"`{name} = {name}.full_tensor()` right after clipping, on every rank",
                "with sharded parameters clip_grad_norm_ returns a DTensor; full_tensor() gives every rank the "
                "global norm (a collective, so it stays outside any rank-0 branch)",
                "a DTensor cannot be formatted as a number, and a local read differs per rank",
            )


def _following(stmt, facts: ScriptFacts):
    block = facts.resolver.block_of(stmt)
    body = list(block.body) if block is not None else []
    i = body.index(stmt) if stmt in body else -1
    return body[i + 1] if 0 <= i < len(body) - 1 else None


def _read_later(name: str, stmt, facts: ScriptFacts) -> bool:
    """Anything after the assignment, in its function, reads the name."""
    function = facts.resolver.enclosing_function(stmt)
    seen = False
    for other in facts.resolver.nodes(cst.SimpleStatementLine):
        if other is stmt:
            seen = True
            continue
        if seen and facts.resolver.enclosing_function(other) is function and name in names_in(other):
            return True
    return False
