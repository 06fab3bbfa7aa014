"""loss_scale: scale the backward of a sum-reduced loss by the world size, where the rewrite splits the
training batches between the ranks (analysis/data_split.py); left unscaled, and reported, where it does not.
A sum divided by the rank's batch size to a power k other than 1 (`per_sample.sum() / b ** 2`) is scaled by
world_size ** (1 - k); a sum over what a call returns that cannot be read is reported."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.data_split import training_data_split
from fsdp2_retrofit.analysis.loss_reduction import (
    BATCHED, MIXED, SUM, UNKNOWN, LossReduction, batch_power, loss_reductions,
)
from fsdp2_retrofit.analysis.process_group import world_size_name
from fsdp2_retrofit.syntax.names import assigned_names
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

WHY_POWER = (
    "FSDP2 averages gradients over the ranks: each rank divides its sum over its part of the batch by its own "
    "batch size (batch_size / world_size samples) to the power {power}, so the average of the ranks' gradients "
    "is world_size ** {excess} times the gradient of the single-process run at the global batch; `{loss}` itself "
    "(what the script logs) stays this rank's value"
)
WHY = (
    "FSDP2 averages gradients over the ranks: a loss summed over each rank's part of the batch then gives "
    "1/world_size of the gradient of the sum over the global batch, which the single-process run computes; "
    "`{loss}` itself (what the script logs) stays this rank's sum: its mean over the ranks is 1/world_size "
    "of the single-process value"
)


class ScaleSummedLossCommand(RetrofitStage):
    DESCRIPTION = "Scale the backward of a loss summed over the batch by the world size (FSDP2 averages gradients)."
    CODE = "loss_scale"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        r = facts.resolver
        split = None
        for found in loss_reductions(r, facts):
            kind = found.kind
            if kind == MIXED:
                self._refuse_mixed(found)
            if kind == UNKNOWN:
                split = split or training_data_split(facts)
                self._report_unread_sums(found, split)
            if kind not in (SUM, BATCHED):
                continue
            split = split or training_data_split(facts)
            lines = ", ".join(f"line {r.line(t.node)}" for t in found.of_kind(kind))
            if kind == BATCHED:
                self._scale_power(found, facts, editor, split, lines)
                continue
            if split.split is False:
                self.attention(
                    found.backward,
                    f"FSD119: `{code(found.backward)}` left unscaled although every term of the loss is a sum over the "
                    f"batch ({lines}): the training data is not split between the ranks: {split.why} (`check`, which "
                    "does not follow the data, still reports its sum-reduced-loss here)",
                    "FSDP2 averages the ranks' gradients: where every rank's loss covers the whole batch, that "
                    "average is the single-process gradient already, and scaling by the world size would make it "
                    "world_size times too large; split the data (a DataLoader with DistributedSampler) and scale "
                    "the backward by dist.get_world_size() together",
                )
                continue
            world = self._world_size(found, facts)
            receiver = found.loss is found.backward.func.value
            editor.replace_expression(found.loss, lambda updated, w=world, p=receiver: self._scaled(updated, w, p))
            unsure = "" if split.split else f"; scaled as if each rank's loss covers its part of the batch: {split.why}"
            before = code(found.backward.func.value)
            after = f"({code(found.loss)} * {world})" if receiver else before.replace(
                code(found.loss), f"{code(found.loss)} * {world}", 1
            )
            self.change(
                found.backward,
                f"`{before}.backward()` -> `{after}.backward()`: every term of the loss is a sum over the batch "
                f"({lines}){unsure}",
                WHY.format(loss=code(found.loss)),
                "left as is, the gradients are world_size times too small: training as with the learning rate "
                "divided by the number of ranks (no error)",
            )

    def _scaled(self, updated: cst.BaseExpression, world: str, receiver: bool, op: str = "*") -> cst.BaseExpression:
        text = code(updated)
        atomic = isinstance(updated, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) or updated.lpar
        scaled = f"{text if atomic else f'({text})'} {op} {world}"
        return self.expr(f"({scaled})" if receiver else scaled)

    def _scale_power(self, found: LossReduction, facts: ScriptFacts, editor: StatementEditor, split, lines: str) -> None:
        """A loss whose every term is a sum over the batch divided by the batch size to the power k (not 0,
        not 1): the backward times world_size ** (1 - k)."""
        excess = found.power - 1  # world_size ** excess too large (too small for a negative power)
        if split.split is False:
            self.attention(
                found.backward,
                f"`{code(found.backward)}` left as is: its loss is a sum over the batch divided by the batch size to "
                f"the power {found.power} ({lines}), but the training data is not split between the ranks: {split.why}",
                "every rank's loss covers the whole batch, so its gradient is the single-process one already",
            )
            return
        world = self._world_size(found, facts)
        factor = world if abs(excess) == 1 else f"{world} ** {abs(excess)}"
        op = "/" if excess > 0 else "*"
        receiver = found.loss is found.backward.func.value
        editor.replace_expression(
            found.loss, lambda updated, w=factor, p=receiver, o=op: self._scaled(updated, w, p, o))
        before = code(found.backward.func.value)
        text = code(found.loss)
        after = f"({text} {op} {factor})" if receiver else before.replace(text, f"{text} {op} {factor}", 1)
        unsure = "" if split.split else f"; scaled as if each rank's loss covers its part of the batch: {split.why}"
        self.change(
            found.backward,
            f"`{before}.backward()` -> `{after}.backward()`: the loss is a sum over the batch divided by the rank's "
            f"batch size to the power {found.power} ({lines}){unsure}",
            WHY_POWER.format(power=found.power, excess=excess, loss=text),
            f"left as is, the gradients are world_size ** {excess} times the single-process ones "
            "(training as with the learning rate scaled by that, no error)",
        )

    def _report_unread_sums(self, found: LossReduction, split) -> None:
        """A `.sum()` over what a call returns that the analysis cannot read: one loss per sample (a sum over
        the batch, to be scaled) or one loss already? Said at the sum, where the data is split."""
        if split.split is False:
            return
        for term in found.terms:
            if not term.unread_sum:
                continue
            self.attention(
                term.node,
                f"`{code(term.node)}` sums what a call returns that the rewrite cannot read; if that is one loss per "
                "sample (`reduction=\"none\"`), this is a sum over each rank's part of the batch and its backward "
                f"(line {self.line(found.backward)}) is left unscaled",
                "FSDP2 averages gradients over the ranks: a loss summed over each rank's part of the batch gets "
                "1/world_size of the single-process gradient; if the call returns per-sample losses, multiply this "
                "term by dist.get_world_size() (or take its mean and divide by the batch size as the original does)",
            )

    def _world_size(self, found: LossReduction, facts: ScriptFacts) -> str:
        """The script's world-size name where the backward can read it, else dist.get_world_size()."""
        r = facts.resolver
        name = world_size_name(facts)
        scope = facts.entry_scope if isinstance(facts.entry_scope, cst.FunctionDef) else None
        if name is not None and r.enclosing_function(found.backward) is scope:
            bound = [
                s for s in r.nodes(cst.SimpleStatementLine)
                if r.enclosing_function(s) is scope and name in assigned_names(s)
            ]
            if bound and r.order(bound[0]) < r.order(found.backward):
                return name
        self.add_import("torch.distributed", asname="dist")
        return "dist.get_world_size()"

    def _refuse_mixed(self, found: LossReduction) -> None:
        reduced = sorted((t for t in found.terms if batch_power(t) is not None), key=batch_power)
        summed, averaged = reduced[0], next(t for t in reduced if batch_power(t) != batch_power(reduced[0]))
        self.refuse(
            "FSR960",
            summed.node,
            f"`{code(summed.node)}` is {_reduced_as(summed)}, and the loss that reaches backward() (line "
            f"{self.line(found.backward)}) also adds `{code(averaged.node)}` (line {self.line(averaged.node)}), "
            f"{_reduced_as(averaged, 'it')}",
            "FSDP2 averages gradients over the ranks: the averaged term keeps the single-process gradient, the "
            "summed one gets 1/world_size of it; no one scale of the backward makes both right",
            "reduce every term the same way (divide the summed term by the batch size, or sum the averaged one), "
            "or scale the summed term by dist.get_world_size() yourself",
        )


def _reduced_as(term, batch: str = "the batch") -> str:
    power = batch_power(term)
    if power == 0:
        return f"summed over {batch}"
    if power == 1:
        return f"averaged over {batch}"
    return f"summed over {batch} and divided by the batch size to the power {power}"
