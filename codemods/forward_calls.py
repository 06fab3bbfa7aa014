"""forward_calls: call sharded modules, never their `.forward`."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.model_classes import called_methods, parameter_reads
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

class ReplaceForwardCallsCommand(RetrofitStage):
    DESCRIPTION = "Replace model.forward(x) with model(x); register other entry points of sharded models."
    CODE = "forward_calls"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        for call in facts.forward_calls:
            editor.replace_expression(call, lambda updated: updated.with_changes(func=updated.func.value))
            self.change(
                call,
                f"`{call.func.value.value}.forward(...)` -> `{call.func.value.value}(...)`",
                "FSDP2 gathers a unit's parameters in forward hooks, which only run when the module is called",
                "`.forward(` on a sharded module runs on sharded (unusable) parameters",
            )
        for model in facts.models:
            root = facts.root_shard.get(model.name)
            if root is None:
                continue
            for method in self._entry_points(model, facts):
                line = f'register_fsdp_forward_method({model.name}, "{method}")\n'
                if any(line.strip() in facts.resolver.module.code_for_node(s) for s in _after(root, facts)):
                    continue
                editor.insert_after(root, [self.stmt(line)])
                self.add_import(self.options.fsdp_module, "register_fsdp_forward_method")
                self.change(
                    root,
                    f"register `{model.name}.{method}` as a forward method",
                    f"`{method}` runs the model outside __call__; registering it runs FSDP2's hooks around it",
                    "parameters stay sharded during generate-style calls",
                )

    def _entry_points(self, model, facts: ScriptFacts):
        """Methods of the model's own class, called on it, that run its submodules or read
        its parameters (`next(self.parameters()).new_zeros(...)` in an init_hidden: outside
        a registered method that parameter is a DTensor shard, and so is what is built from it)."""
        info = facts.classes.get(model.class_name)
        if info is None:
            return []
        return [m for m in called_methods(model.name, info, facts.resolver)
                if _runs_self(info.methods[m], info) or parameter_reads(info.methods[m], info)]


def _runs_self(method: cst.FunctionDef, info) -> bool:
    """The method runs the model's computation: it calls `self(...)`, `self.forward(...)`
    or one of its submodules (`self.blocks[0](x)`, `self.head(x)`), or a block of a
    repeated container in a loop. Methods that only read parameters
    (`configure_optimizers`) do not count."""
    submodules = set(info.submodules) | {c.path[0] for c in info.containers}
    found = []

    class _V(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            f = node.func
            while isinstance(f, cst.Subscript):
                f = f.value
            if isinstance(f, cst.Name) and f.value == "self":
                found.append(node)
            elif isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and f.value.value == "self":
                if f.attr.value == "forward" or f.attr.value in submodules:
                    found.append(node)

        def visit_For(self, node: cst.For) -> None:
            it = node.iter
            if isinstance(it, cst.Attribute) and isinstance(it.value, cst.Name) and it.value.value == "self":
                if it.attr.value in submodules:
                    found.append(node)

    method.body.visit(_V())
    return bool(found)


def _after(stmt, facts: ScriptFacts):
    block = facts.resolver.block_of(stmt)
    body = list(block.body) if block is not None else []
    return body[body.index(stmt) + 1 :] if stmt in body else []
