"""penalty_reshard: reshard a gradient penalty's model before each step of its optimizer.

The shard stage keeps every unit of a model that a gradient penalty differentiates twice
gathered from forward through backward (analysis/penalties.py). The optimizer steps the
shards, so the gathered copies are stale after the step: the units are resharded just
before it, and the next forward gathers the stepped shards. Without that the next forward
computes with the previous step's weights."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.penalties import penalty_models, penalty_steps
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.syntax.torch_api import AUTOGRAD_GRAD


class ReshardBeforePenaltyStepCommand(RetrofitStage):
    DESCRIPTION = "Reshard a gradient penalty's model (kept gathered through backward) before its optimizer steps."
    CODE = "penalty_reshard"

    @classmethod
    def may_edit(cls, earlier: ScriptFacts) -> bool:
        return any(earlier.resolver.is_call_to(c, AUTOGRAD_GRAD) for c in earlier.resolver.nodes(cst.Call))

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        for model in penalty_models(facts):
            if not model.sharded:
                continue
            for step, holder in penalty_steps(facts, model):  # none: refused FSR624 (analysis/penalties.py)
                stmt = facts.resolver.statement_of(step)
                if _resharded_before(facts, stmt):
                    continue
                unit = self.fresh_name("unit", facts.resolver.enclosing_function(stmt))
                editor.insert_before(stmt, [self.stmt(
                    f"for {unit} in {holder}.modules():  # gathered since forward for the gradient penalty\n"
                    f"    if isinstance({unit}, FSDPModule):\n"
                    f"        {unit}.reshard()\n"
                )])
                self.add_import(self.options.fsdp_module, "FSDPModule")
                self.change(
                    step,
                    f"reshard every unit of `{holder}` before `{code(step)}`",
                    "its units keep their gathered parameters through backward (its gradient penalty reads them "
                    "twice); the optimizer steps the shards, so the next forward must gather them again",
                    "without it the next forward computes with the gathered copy of the weights before the step",
                )


def _resharded_before(facts: ScriptFacts, stmt) -> bool:
    """The statement before `stmt` is a loop that reshards (a second rewrite of the output)."""
    block = facts.resolver.block_of(stmt)
    body = list(block.body) if block is not None else []
    at = body.index(stmt) if stmt in body else 0
    return at > 0 and isinstance(body[at - 1], cst.For) and ".reshard()" in code(body[at - 1])
