"""returned_optimizer: a helper that builds its optimizer inside the tuple it returns
(`return model, torch.optim.AdamW(model.parameters())`) binds it to a name first, so that
the launch and shard stages follow it out of the helper like any returned optimizer and
fully_shard can go between the model and the optimizer."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.syntax.torch_api import is_optimizer_call
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor


class NameReturnedOptimizerCommand(RetrofitStage):
    DESCRIPTION = "Bind an optimizer built inside a returned tuple to a name before the `return`."
    CODE = "optimizer"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        r = facts.resolver
        for ret in r.nodes(cst.Return):
            fn = r.enclosing_function(ret)
            line = r.parent(ret)
            if fn is None or not isinstance(ret.value, cst.Tuple) or not isinstance(line, cst.SimpleStatementLine) \
                    or len(line.body) != 1:
                continue
            elements = ret.value.elements
            built = [i for i, e in enumerate(elements) if isinstance(e.value, cst.Call) and is_optimizer_call(r, e.value)]
            # the elements before it are evaluated before it: only names and attributes may move after it
            if len(built) != 1 or any(type(e) is not cst.Element or not isinstance(e.value, (cst.Name, cst.Attribute))
                                      for e in elements[: built[0]]):
                continue
            call = elements[built[0]].value
            name = self.fresh_name("optimizer", fn)
            editor.insert_before(line, [self.stmt(f"{name} = {code(call)}\n")])
            named = elements[built[0]].with_changes(value=cst.Name(name))
            new_elements = [*elements[: built[0]], named, *elements[built[0] + 1:]]
            new_line = line.with_changes(body=[ret.with_changes(value=ret.value.with_changes(elements=new_elements))])
            self.carry(line, new_line)
            editor.replace(line, new_line)
            self.change(
                line,
                f"bind the optimizer {fn.name.value}() returns to `{name}` before its `return`",
                "fully_shard must run between the model's build and the optimizer's; as a name, the optimizer "
                "is followed out of the function with the model",
            )
