"""forward_calls: call sharded modules, never their `.forward`."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.flow import innermost_call
from fsdp2_retrofit.analysis.model_classes import handed_submodules, parameter_reads, runs_self
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
            for method, everywhere in self._entry_points(model, facts):
                line = f'register_fsdp_forward_method({model.name}, "{method}")\n'
                if any(line.strip() in facts.resolver.module.code_for_node(s) for s in _after(root, facts)):
                    continue
                if not everywhere:  # a class the model may be (chosen at run time) has no such method
                    line = f'if hasattr({model.name}, "{method}"):\n    {line}'
                editor.insert_after(root, [self.stmt(line)])
                self.add_import(self.options.fsdp_module, "register_fsdp_forward_method")
                self.change(
                    root,
                    f"register `{model.name}.{method}` as a forward method"
                    + ("" if everywhere else f" (where the class chosen at run time has `{method}`)"),
                    f"`{method}` runs the model outside __call__; registering it runs FSDP2's hooks around it",
                    "parameters stay sharded during generate-style calls",
                )

    def _entry_points(self, model, facts: ScriptFacts):
        """(method, whether every class the model may be has it) for the methods of the model's class, or of
        any class chosen for it at run time (`if args.model == "LSTM": model = RNNModel(...) else: ...`),
        called on it, that run its submodules or read its parameters (`next(self.parameters()).new_zeros(...)`
        in an init_hidden: outside a registered method that parameter is a DTensor shard, and so is what is
        built from it)."""
        infos = [facts.classes.get(c) for c in (model.alternatives or [model.class_name])]
        found = []
        for info in infos:
            if info is None:
                continue
            build = _build_call(model) if info is facts.classes.get(model.class_name) else None
            handed = handed_submodules(info, build, facts.resolver, facts.classes)
            found += [m for m in facts.methods_called_on(model, info) if m not in found and (
                runs_self(info.methods[m], info, handed) or parameter_reads(info.methods[m], info))]
        return [(m, all(info is not None and m in info.methods for info in infos)) for m in found]


def _build_call(model):
    """The call that builds the model in its statement (`DDPM(eps_model=NaiveUnet(...))` of
    `ddpm = DDPM(...).to(device)`), or None."""
    small = model.stmt.body[0] if model.stmt.body else None
    if isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None:
        return innermost_call(small.value)
    return None


def _after(stmt, facts: ScriptFacts):
    block = facts.resolver.block_of(stmt)
    body = list(block.body) if block is not None else []
    return body[body.index(stmt) + 1 :] if stmt in body else []
