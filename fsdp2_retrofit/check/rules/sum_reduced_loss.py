"""FSD119 sum-reduced-loss."""
from __future__ import annotations

from typing import Dict, Iterator, List, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import calls_in, names_in
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
    "from torch.distributed.fsdp import fully_shard\nmodel = Net()\nfully_shard(model)\n"
)
_LOOP = "for x, y in loader:\n    loss = {loss}\n    loss.backward()\n"


class SumReducedLoss(Rule):
    """Checks for a sum-reduced loss that reaches `backward()` in a sharded script.

    ## What it does
    In a script that shards a model with `fully_shard`, flags a loss computed with
    `reduction="sum"` (or the old `size_average=False`) and not divided by the batch's
    size (`/ x.size(0)`, `/ len(batch)`, `/ batch_size`), called directly
    (`F.binary_cross_entropy(out, x, reduction="sum")`) or through a criterion built
    with it (`criterion = nn.MSELoss(reduction="sum")`), whose value flows (through
    assignments in the same function) into a `.backward()`.

    ## Why is this bad?
    FSDP2 averages gradients over the ranks (its reduce-scatter divides by the
    world size). With a mean-reduced loss, the average of the per-rank means is the
    mean over the global batch: the step equals a single process's on that batch.
    With a sum-reduced loss it is the sum over the global batch divided by the world
    size: every step is world_size times smaller than the single-process step on the
    same data (and the printed loss is per rank), silently.

    ## Example
    ```python
    loss = F.binary_cross_entropy(recon, x, reduction="sum")
    loss.backward()
    ```

    ## Use instead
    ```python
    loss = F.binary_cross_entropy(recon, x, reduction="sum") * dist.get_world_size()
    loss.backward()
    ```
    (the gradient of the sum over the global batch), or a mean-reduced loss with a
    learning rate scaled to match.

    ## Fix safety
    No automatic fix: whether the script meant the sum over the global batch or over
    one rank's batch is a choice (it changes the effective learning rate).
    """

    CODE = "FSD119"
    NAME = "sum-reduced-loss"
    MESSAGE = (
        "sum-reduced loss `{call}` reaches backward() (line {backward}): FSDP2 averages gradients over ranks, so the "
        "step is 1/world_size of the single-process step on the same global batch; multiply by world_size or use a mean"
    )
    TRIGGERS = ("sum", "size_average")
    VALID = (
        Valid(_HEAD + _LOOP.format(loss="F.cross_entropy(model(x), y)")),
        Valid(_HEAD + "total = 0.0\nfor x, y in val_loader:\n    total += F.cross_entropy(model(x), y, "
              "reduction='sum').item()\n"),  # evaluation: no backward
        Valid("import torch.nn.functional as F\nfor x, y in loader:\n    loss = F.mse_loss(net(x), y, reduction='sum')\n"
              "    loss.backward()\n"),  # nothing sharded
        Valid(_HEAD + _LOOP.format(loss="F.mse_loss(model(x), y, reduction='sum') / x.size(0)")),
        Valid(_HEAD + "import torch.distributed as dist\n"
              + _LOOP.format(loss="F.mse_loss(model(x), y, reduction='sum') * dist.get_world_size()")),
    )
    INVALID = (
        Invalid(_HEAD + _LOOP.format(loss="F.mse_loss(model(x), y, reduction='sum')"), line=8),
        Invalid(  # the old keyword, summed with another term before backward
            _HEAD + "for x in loader:\n    recon, kl = model(x)\n"
            "    rec = F.binary_cross_entropy(recon, x, size_average=False)\n    loss = rec + kl\n"
            "    loss.backward()\n",
            line=9,
        ),
        Invalid(  # a criterion built with reduction='sum', inside a function
            _HEAD + "criterion = nn.MSELoss(reduction='sum')\ndef train(model, loader):\n    for x, y in loader:\n"
            "        criterion(model(x), y).backward()\n",
            line=10,
        ),
    )

    def check(self, ctx):
        if not ctx.shards.uses_fully_shard:
            return
        r = ctx.resolver
        sum_criteria = self._sum_criteria(ctx)
        flagged: Set[int] = set()
        for call in ctx.nodes(cst.Call):
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "backward"):
                continue
            chain: List[cst.BaseExpression] = []
            feeding = list(self._feeding_calls(ctx, func.value, call, chain))
            if any("world_size" in _code(e) for e in chain):
                continue  # scaled back to the sum over the global batch
            if any(_per_sample(e) for e in chain):
                continue  # divided by the batch's size: a mean per rank after all
            for loss in feeding:
                if id(loss) in flagged:
                    continue
                if _sum_keyword(loss) or (isinstance(loss.func, cst.Name) and loss.func.value in sum_criteria):
                    flagged.add(id(loss))
                    yield loss, {"call": _short(loss), "backward": str(r.line(call))}, None

    def _sum_criteria(self, ctx) -> Set[str]:
        """Names bound to a loss module built with reduction='sum' (`nn.MSELoss(reduction='sum')`)."""
        out = set()
        for assign in ctx.nodes(cst.Assign):
            value = assign.value
            if isinstance(value, cst.Call) and _sum_keyword(value):
                if any(n.startswith("torch.nn.") and n.endswith("Loss") for n in ctx.resolver.qnames(value)):
                    for t in assign.targets:
                        if isinstance(t.target, cst.Name):
                            out.add(t.target.value)
        return out

    def _feeding_calls(self, ctx, expr: cst.BaseExpression, at: cst.CSTNode, chain: list) -> Iterator[cst.Call]:
        """The calls in `expr` and in the values assigned (in its function) to the names it reads
        (each expression visited is added to `chain`)."""
        r = ctx.resolver
        fn = r.enclosing_function(at)
        scope = fn if fn is not None else ctx.module
        assigned: Dict[str, List[cst.BaseExpression]] = {}
        for node in r.descendants(scope, cst.Assign) + r.descendants(scope, cst.AugAssign):
            if r.enclosing_function(node) is not fn:
                continue
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            for t in targets:
                for name in _target_names(t):
                    assigned.setdefault(name, []).append(node.value)
        seen: Set[str] = set()
        todo = [expr]
        while todo:
            e = todo.pop()
            chain.append(e)
            yield from calls_in(e)
            if isinstance(e, cst.Call):
                yield e
            for name in names_in(e):
                if name not in seen:
                    seen.add(name)
                    todo.extend(assigned.get(name, []))


_SIZES = ("size(", "len(", "shape", "numel", "batch")


def _per_sample(expr) -> bool:
    """`... / x.size(0)`, `/ len(batch)`, `/ batch_size`: a sum turned into a mean."""
    for node in [expr, *expr.children] if isinstance(expr, cst.BinaryOperation) else [expr]:
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Divide, cst.FloorDivide)):
            if any(word in _code(node.right) for word in _SIZES):
                return True
    return False


def _target_names(target) -> List[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in _target_names(el.value)]
    return []


def _sum_keyword(call: cst.Call) -> bool:
    for arg in call.args:
        if arg.keyword is None:
            continue
        key, value = arg.keyword.value, arg.value
        if key == "reduction" and isinstance(value, cst.SimpleString) and value.evaluated_value == "sum":
            return True
        if key == "size_average" and isinstance(value, cst.Name) and value.value == "False":
            return True
    return False


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)


def _short(node) -> str:
    text = _code(node)
    return text if len(text) <= 60 else text[:57] + "..."
