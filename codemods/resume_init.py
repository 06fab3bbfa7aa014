"""resume_init: a resume-or-initialise `if` after the build splits in two, so that the
initialisation runs on the whole model before fully_shard and the load after it."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.init_branches import init_branch
from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

_INVERSE = {"==": "!=", "!=": "==", "is": "is not", "is not": "is", "in": "not in", "not in": "in"}


class SplitResumeInitCommand(RetrofitStage):
    DESCRIPTION = ("Split `if resume: load else: init` after the build into `if not resume: init` "
                   "(before fully_shard) and `if resume: load` (after it).")
    CODE = "resume_init"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if self.options.meta_init:
            return  # --meta-init draws new weights after to_empty: its own stage re-runs the init
        done = set()
        for model in facts.models:
            if model.late_init is None:
                continue
            top = self._statement_of(model.late_init, model, facts)
            found = init_branch(top) if top is not None else None
            if found is None or top in done:
                continue  # left as it is: shard flags the initialisation of the sharded model
            done.add(top)
            self._split(found, editor)

    def _statement_of(self, node, model, facts: ScriptFacts):
        """The statement of the model's block that holds `node`."""
        body = list(model.block.body)
        while node is not None and node not in body:
            node = facts.resolver.parent(node)
        return node

    def _split(self, found, editor: StatementEditor) -> None:
        stmt = found.stmt
        test, negated = stmt.test, self._negate(stmt.test)
        init_test, other_test = (negated, test) if found.init_in_else else (test, negated)
        init_block = found.init_block
        if init_block.header.comment is None:
            init_block = init_block.with_changes(header=cst.TrailingWhitespace(
                whitespace=cst.SimpleWhitespace("  "),
                comment=cst.Comment(f"# on the whole model{'s' if len(found.models) > 1 else ''}, before fully_shard"),
            ))
        first = stmt.with_changes(test=init_test, body=init_block, orelse=None)
        second = cst.If(test=other_test, body=found.other_block)
        self.carry(stmt, first)
        self.carry(stmt, second)
        editor.insert_before(stmt, [first])
        editor.replace(stmt, second)
        names = ", ".join(f"`{n}`" for n in sorted(found.models))
        self.change(
            stmt,
            f"split `if {code(stmt.test)}`: the initialisation of {names} (`if {code(init_test)}`) runs before "
            f"fully_shard, the other branch (`if {code(other_test)}`) after it",
            "the initialisation draws the whole modules' weights, as the single-process run does under the same "
            "seed; the load stays after fully_shard, where a checkpoint of the sharded model is read",
            "an initialisation run on the sharded model draws each rank's shards on its own: the run does not "
            "start from the single-process weights",
        )

    def _negate(self, test: cst.BaseExpression) -> cst.BaseExpression:
        """`not test`, written without a `not` where one comparison can be inverted."""
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            inner = test.expression
            return inner.with_changes(lpar=[], rpar=[]) if not isinstance(inner, cst.BooleanOperation) else inner
        if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and not test.lpar:
            op = code(test.comparisons[0].operator)
            op = " ".join(op.split())
            if op in _INVERSE:
                return self.expr(f"{code(test.left)} {_INVERSE[op]} {code(test.comparisons[0].comparator)}")
        if isinstance(test, (cst.BooleanOperation, cst.IfExp)):
            return self.expr(f"not ({code(test)})")
        return self.expr(f"not {code(test)}")
