"""handed_models: a model built inside the call that hands it to a trainer
(`trainer = Trainer(Net().to(device), lr=0.1)`, `Solver(config, net=Regressor(width)).train()`)
is bound to a name on the line before, so that the later stages find it like any model the
script builds: shard puts fully_shard on that name before the call, and the trainer's
optimizer (`torch.optim.SGD(self.model.parameters())` in its `__init__`) is built from the
sharded model it is handed.

Only a build handed to a class or function of the project (the script's or a sibling
module's) moves, a construction of a module class of the project or a library model, or a call of a
function of the script or a sibling module that builds and returns one (`Trainer(build_net(cfg))`), and
a construction only when the rewrite finds no model bound to a name otherwise (a factory's model
is bound inside it, and reaches the caller only through this call); the
arguments before it are evaluated before it and must be names, attributes or literals (a
call among them would change order). A build passed to a library call (`torch.compile(Net())`,
`DDP(Net())`) is the other stages' concern."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.model_builds import handed_build, project_callee
from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

_PLAIN = (cst.Name, cst.Attribute, cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString)


class NameHandedModelsCommand(RetrofitStage):
    DESCRIPTION = "Bind a model built inside a call to a trainer or helper of the project to a name before the call."
    CODE = "handed_models"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        r = facts.resolver
        done = set()
        for call in r.nodes(cst.Call):
            if not project_callee(call, r, facts.classes):
                continue
            line = r.statement_of(call)
            if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1 or id(line) in done:
                continue
            if isinstance(line.body[0], cst.Return) or not self._plain_path(call, line, r):
                continue
            args = list(call.args)
            kinds = {i: handed_build(a.value, facts) for i, a in enumerate(args) if a.star == ""}
            # a construction moves only where no model is bound otherwise (the script's other stages found
            # none); a factory's model is bound inside it and reaches the caller only through this call
            built = [i for i, kind in kinds.items() if kind == "factory" or kind == "construction" and not facts.models]
            if not built or any(a.star or (i not in built and not isinstance(a.value, _PLAIN))
                                for i, a in enumerate(args[: built[-1]])):
                continue  # evaluated before a build: it may not move after it
            scope = r.enclosing_function(line)
            statements, taken = [], set()
            for i in built:
                name = self.fresh_name("model", scope)
                while name in taken:
                    name = self.fresh_name(f"model_{len(taken) + 1}", scope)
                taken.add(name)
                value = args[i].value
                args[i] = args[i].with_changes(value=cst.Name(name))
                statements.append(self.stmt(f"{name} = {code(value)}\n"))
                self.change(
                    line,
                    f"bind the model built in `{code(call.func)}(...)`'s arguments, `{code(value)}`, to `{name}` "
                    "before the call",
                    "fully_shard needs the model as a name before the code it is handed to builds an optimizer "
                    "from its parameters; bound, it is sharded where it is built",
                )
            new_line = line.with_changes(body=[_replace(line.body[0], call, call.with_changes(args=args))],
                                         leading_lines=[])
            statements[0] = statements[0].with_changes(leading_lines=line.leading_lines)
            self.carry(line, new_line)
            editor.insert_before(line, statements)
            editor.replace(line, new_line)
            done.add(id(line))

    @staticmethod
    def _plain_path(call: cst.Call, line: cst.SimpleStatementLine, r) -> bool:
        """The call is evaluated once, first, when its line runs: not inside a lambda, a comprehension
        or a conditional expression, nor inside another call's arguments (`Trainer(Net()).fit(x)`:
        the receiver of a method call is evaluated before the method's arguments)."""
        for anc in r.ancestors(call):
            if anc is line:
                return True
            if isinstance(anc, (cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp, cst.IfExp,
                                cst.BooleanOperation, cst.Arg, cst.BinaryOperation, cst.Subscript, cst.Tuple,
                                cst.List, cst.Dict, cst.Set, cst.Comparison)):
                return False
        return False


def _replace(small: cst.BaseSmallStatement, old: cst.Call, new: cst.Call) -> cst.BaseSmallStatement:
    class _Swap(cst.CSTTransformer):
        def on_leave(self, original, updated):
            return new if original is old else updated

    return small.visit(_Swap())
