"""returned_builds: a helper that builds its optimizer or its DataLoader in the `return`
itself (`return model, torch.optim.AdamW(model.parameters())`, `return DataLoader(ds, ...)`)
binds it to a name first, so that the later stages follow it out of the helper like any
returned name: launch and shard put fully_shard between the model and the optimizer, and
the data stage gives the loader its DistributedSampler where it is built."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.syntax.torch_api import DATALOADERS, is_optimizer_call
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

_WHY = {
    "optimizer": "fully_shard must run between the model's build and the optimizer's; as a name, the optimizer "
                 "is followed out of the function with the model",
    "loader": "the DistributedSampler goes where the DataLoader is built; as a name, the loader is followed "
              "out of the function to the loop that trains on it",
}


class NameReturnedBuildsCommand(RetrofitStage):
    DESCRIPTION = "Bind an optimizer or a DataLoader built in a `return` to a name before the `return`."
    CODE = "returns"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        r = facts.resolver
        for ret in r.nodes(cst.Return):
            fn = r.enclosing_function(ret)
            line = r.parent(ret)
            if fn is None or ret.value is None or not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
                continue
            alone = not isinstance(ret.value, cst.Tuple)
            elements = [cst.Element(ret.value)] if alone else list(ret.value.elements)
            kinds = {i: self._kind(r, e.value, facts.training_loader_calls) for i, e in enumerate(elements) if type(e) is cst.Element}
            built = [i for i, kind in kinds.items() if kind is not None]
            optimizers = [i for i in built if kinds[i] == "optimizer"]
            if not built or len(optimizers) > 1 or (alone and optimizers):
                continue  # two optimizers stay for the shard stage's refusal; a factory's optimizer is followed
            # the elements before the last one bound are evaluated before it: only names, attributes and the
            # other bound builds may move after it
            if any(i not in built and (type(e) is not cst.Element or not isinstance(e.value, (cst.Name, cst.Attribute)))
                   for i, e in enumerate(elements[: built[-1]])):
                continue
            new_elements, statements, taken = list(elements), [], set()
            for i in built:
                name = self.fresh_name(kinds[i], fn)
                while name in taken:
                    name = self.fresh_name(f"{name}_{len(taken) + 1}", fn)
                taken.add(name)
                statements.append(self.stmt(f"{name} = {code(elements[i].value)}\n"))
                new_elements[i] = elements[i].with_changes(value=cst.Name(name))
                self.change(
                    line,
                    f"bind the {'DataLoader' if kinds[i] == 'loader' else 'optimizer'} {fn.name.value}() returns to "
                    f"`{name}` before its `return`",
                    _WHY[kinds[i]],
                )
            value = new_elements[0].value if alone else ret.value.with_changes(elements=new_elements)
            # the comments above the `return` stay above the statement that now builds what it returned
            statements[0] = statements[0].with_changes(leading_lines=line.leading_lines)
            new_line = line.with_changes(body=[ret.with_changes(value=value)], leading_lines=[])
            self.carry(line, new_line)
            editor.insert_before(line, statements)
            editor.replace(line, new_line)

    @staticmethod
    def _kind(r, value, training):
        """"loader" for a DataLoader that feeds a training loop (an evaluation loader stays as
        written), "optimizer" for an optimizer's construction, else None."""
        if not isinstance(value, cst.Call):
            return None
        if r.is_call_to(value, DATALOADERS):
            return "loader" if id(value) in training else None
        return "optimizer" if is_optimizer_call(r, value) else None
