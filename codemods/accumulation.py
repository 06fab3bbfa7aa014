"""accumulation: reduce gradients once per optimizer step, not once per micro-batch."""
from __future__ import annotations

from typing import Optional, Tuple

import libcst as cst

from fsdp2_retrofit.analysis import LoopSite, ScriptFacts, code
from fsdp2_retrofit.analysis.step_condition import Ahead, before, statements_between
from fsdp2_retrofit.syntax.names import names_in
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

TRADE = (
    "FSDP2's replacement for no_sync(): the micro-batches before the last keep their gradients "
    "unsharded on each rank and the last one reduce-scatters the sum once (one reduction per "
    "optimizer step instead of one per micro-batch, at the cost of holding unsharded gradients); "
    "--accumulation-sync every keeps reducing each micro-batch (sharded gradients, less memory, more communication)"
)
HOLD = (
    "the micro-batches before the last keep their gathered parameters after backward, so the next "
    "micro-batch's forward starts without all-gathering them again (one all-gather per unit fewer "
    "per held micro-batch); the cost: each rank holds the model's unsharded parameters from one "
    "backward to the next forward (until each unit's forward frees them), and the last micro-batch "
    "frees them, so the optimizer steps on shards and the next step gathers fresh values; "
    "--accumulation-params reshard frees them after every backward (less memory, more all-gathers)"
)


class SyncGradientsOncePerStepCommand(RetrofitStage):
    DESCRIPTION = "With gradient accumulation, call set_requires_gradient_sync(<last micro-batch>) before backward()."
    CODE = "accumulation"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        for loop in facts.loops:
            found = self._accumulation(loop, facts, editor)
            if found is None:
                continue
            backward, condition, how = found
            model = self._model(loop, facts)
            if model is None:
                self.attention(
                    backward,
                    "gradient accumulation with more than one model: gradients are reduced on every micro-batch",
                    "call <model>.set_requires_gradient_sync(<last micro-batch>) before backward() for each model",
                )
                continue
            if _already_synced(backward, facts) or any(m in code(loop.node) for m in _DECIDED):
                continue  # the script (or the migration from DDP's no_sync) decides already
            lines = []
            if self.options.accumulation_sync == "every":
                self.change(
                    backward,
                    f"gradient accumulation ({how}) reduces every micro-batch (--accumulation-sync every)",
                    TRADE,
                )
            else:
                lines.append(f"{model}.set_requires_gradient_sync({condition})\n")
                self.change(
                    backward,
                    f"`{model}.set_requires_gradient_sync({condition})` before backward() ({how})",
                    TRADE,
                    "DDP's no_sync()/require_backward_grad_sync do nothing on an FSDP2 module",
                )
            held = hold_parameters(self, backward, model, condition)
            if not held:
                self.change(
                    backward,
                    f"gradient accumulation ({how}) frees the gathered parameters after every backward "
                    "(--accumulation-params reshard)",
                    HOLD,
                )
            if lines or held:
                editor.insert_before(backward, [self.stmt(line) for line in lines] + held)

    def _model(self, loop: LoopSite, facts: ScriptFacts) -> Optional[str]:
        names = sorted(facts.trained_names.get(loop.function, set()))  # not an EMA copy or a teacher
        used = [n for n in names if n in names_in(loop.node)]
        return used[0] if len(used) == 1 else None

    def _accumulation(self, loop: LoopSite, facts: ScriptFacts, editor) -> Optional[Tuple[cst.CSTNode, str, str]]:
        """(the statement that calls backward, the "last micro-batch" condition, how it was found)."""
        r = facts.resolver
        backward = _backward_statement(loop.node, r)
        if backward is None:
            return None
        steps = _optimizer_steps(facts, loop.function)
        if not steps:
            return None
        step = steps[0]
        # an inner micro-batch loop: the optimizer steps after it
        if not _inside(step, loop.node, r):
            return self._micro_loop(loop, facts, editor)
        skip = _skip_gate(backward, step, r)
        if skip is not None:  # `if (i + 1) % accum != 0: continue` before the step
            ahead = self._ahead(backward, skip, r)
            if ahead is None:
                return None
            how = _how(f"the optimizer step is skipped under `if {code(skip.test)}`", ahead)
            return backward, _negate(self.expr(ahead.text)), how
        # a gate inside the loop: `if (i + 1) % accum == 0: optimizer.step()`
        gate = next((a for a in r.ancestors(step) if isinstance(a, cst.If)), None)
        if gate is None or not _inside(gate, loop.node, r) or _inside(backward, gate, r):
            return None
        if isinstance(loop.node, cst.For) and not _inside(gate, loop.node.body, r):
            return None
        ahead = self._ahead(backward, gate, r)
        if ahead is None:
            return None
        return backward, ahead.text, _how("the optimizer steps under `if " + code(gate.test) + "`", ahead)

    def _ahead(self, backward, gate: cst.If, r) -> Optional[Ahead]:
        """The gate's test as it reads before backward() (analysis/step_condition.py), or None
        with an attention item saying why it cannot be computed there."""
        between, why = statements_between(backward, gate, r)
        ahead = before(gate.test, between) if between is not None else Ahead(None, why)
        if ahead.text is None:
            self.attention(
                backward,
                "gradient accumulation whose step condition changes after backward(): gradients are reduced on every micro-batch",
                f"`{code(gate.test)}` is tested after backward() and cannot be computed before it: {ahead.why}; "
                "compute the condition first, then call set_requires_gradient_sync(condition) before backward()",
            )
            return None
        return ahead

    def _micro_loop(self, loop: LoopSite, facts: ScriptFacts, editor) -> Optional[Tuple[cst.CSTNode, str, str]]:
        node = loop.node
        backward = _backward_statement(node, facts.resolver)
        if not isinstance(node, cst.For) or not isinstance(node.iter, cst.Call):
            return None
        func, args = node.iter.func, node.iter.args
        if isinstance(func, cst.Name) and func.value == "range" and len(args) == 1:
            count = code(args[0].value)
            target = node.target
            if not isinstance(target, cst.Name):
                return None
            name = target.value
            if name == "_" and "_" not in names_in(node.body):
                name = self.fresh_name("micro_step", loop.function)
                editor.replace_expression(node, lambda updated, name=name: updated.with_changes(target=cst.Name(name)))
            return backward, f"{name} == {_minus_one(count)}", f"the last of `range({count})` micro-batches"
        if isinstance(func, cst.Name) and func.value == "enumerate" and len(args) == 1:
            target = node.target
            if isinstance(target, cst.Tuple) and isinstance(target.elements[0].value, cst.Name):
                index = target.elements[0].value.value
                seq = code(args[0].value)
                return backward, f"{index} == len({seq}) - 1", f"the last micro-batch of `{seq}`"
        self.attention(
            backward,
            "gradient accumulation over an inner loop whose last iteration is not known: "
            "gradients are reduced on every micro-batch",
            "call set_requires_gradient_sync(<last micro-batch>) before backward() to reduce once per step",
        )
        return None


def hold_parameters(stage: RetrofitStage, node, model: str, condition: str) -> list:
    """`<model>.set_reshard_after_backward(<condition>)` (the statements to put before the
    backward whose gradient sync follows `condition`), recorded in the report; nothing under
    --accumulation-params reshard. The accumulation stage and the DDP migration share it."""
    if stage.options.accumulation_params != "hold":
        return []
    stage.change(
        node,
        f"`{model}.set_reshard_after_backward({condition})` before backward(): gathered parameters "
        "held between the micro-batches of one optimizer step",
        HOLD,
        "parameters still gathered when the optimizer steps would be stale in the next forward: "
        "the last micro-batch reshards",
    )
    return [stage.stmt(f"{model}.set_reshard_after_backward({condition})\n")]


def _skip_gate(backward, step, r) -> Optional[cst.If]:
    """An `if ...: continue` between backward() and the step, in the same block."""
    block = r.block_of(backward)
    if block is None or r.block_of(r.statement_of(step)) is not block:
        return None
    body = list(block.body)
    between = body[body.index(backward) + 1 : body.index(r.statement_of(step))]
    for stmt in between:
        if (
            isinstance(stmt, cst.If)
            and stmt.orelse is None
            and isinstance(stmt.body, cst.IndentedBlock)
            and len(stmt.body.body) == 1
            and isinstance(stmt.body.body[0], cst.SimpleStatementLine)
            and isinstance(stmt.body.body[0].body[0], cst.Continue)
        ):
            return stmt
    return None


def _how(found: str, ahead: Ahead) -> str:
    """How the step condition was found, and the assignments after backward() it was computed through."""
    if not ahead.used:
        return found
    return f"{found}, read before backward() as after {'; '.join(f'`{u}`' for u in ahead.used)}"


def _negate(test: cst.BaseExpression) -> str:
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        op = test.comparisons[0].operator
        flipped = {cst.NotEqual: "==", cst.Equal: "!=", cst.LessThan: ">=", cst.GreaterThanEqual: "<"}.get(type(op))
        if flipped:
            return f"{code(test.left)} {flipped} {code(test.comparisons[0].comparator)}"
    return f"not ({code(test)})"


def _minus_one(count: str) -> str:
    return count[:-4] if count.endswith(" + 1") else f"{count} - 1"


def _backward_statement(loop: cst.CSTNode, r) -> Optional[cst.CSTNode]:
    """The one statement of the loop that calls `.backward()` (not inside a nested def)."""
    found = []
    for call in r.nodes(cst.Call):
        f = call.func
        if isinstance(f, cst.Attribute) and f.attr.value == "backward" and _inside(call, loop, r):
            found.append(r.statement_of(call))
    return found[0] if len(found) == 1 else None


def _optimizer_steps(facts: ScriptFacts, function) -> list:
    """`opt.step()` / `scaler.step(opt)` calls of the optimizers known in `function`, and a
    wrapper's own step method (`optimizer.step_and_update_lr()`: a name whose
    `optimizer._optimizer` is known holds the torch optimizer)."""
    names = set(facts.optimizer_names.get(function, {}))
    wrappers = {n.split(".", 1)[0] for n in names if "." in n}
    out = []
    for call in facts.resolver.nodes(cst.Call):
        f = call.func
        if not isinstance(f, cst.Attribute):
            continue
        wrapper_step = "step" in f.attr.value and isinstance(f.value, cst.Name) and f.value.value in wrappers
        if f.attr.value != "step" and not wrapper_step:
            continue
        if facts.resolver.enclosing_function(call) is not function:
            continue
        owner = f.value
        if isinstance(owner, cst.Name) and owner.value in names:
            out.append(call)
        elif call.args and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value in names:
            out.append(call)  # scaler.step(optimizer)
    return out


def _inside(node, outer, r) -> bool:
    return node is outer or any(a is outer for a in r.ancestors(node))


def _already_synced(backward, facts: ScriptFacts) -> bool:
    block = facts.resolver.block_of(backward)
    body = list(block.body) if block is not None else []
    i = body.index(backward) if backward in body else 0
    return i > 0 and any(m in code(body[i - 1]) for m in _DECIDED)


# FSDP2 calls that show the script (or an earlier rewrite) already handles accumulation
_DECIDED = ("set_requires_gradient_sync", "set_reshard_after_backward")
