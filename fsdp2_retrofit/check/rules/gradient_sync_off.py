"""FSD123 gradient-sync-off."""
from __future__ import annotations

import libcst as cst

from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\nfully_shard(model)\n"
    "opt = torch.optim.AdamW(model.parameters())\n"
)
_LOOP = "for i, x in enumerate(loader):\n    {sync}\n    model(x).sum().backward()\n    opt.step()\n"


class GradientSyncOff(Rule):
    """Checks for gradient synchronisation switched off on a sharded module and never switched back on.

    ## What it does
    Flags `model.set_requires_gradient_sync(False)` on a module sharded with
    `fully_shard` when no other `set_requires_gradient_sync` call on the same module
    passes anything but the literal `False` (`True`, or a condition such as
    `(i + 1) % accum == 0`).

    ## Why is this bad?
    Gradient accumulation turns the reduce-scatter off for the micro-steps and back
    on for the last one. Left off, the gradients are never reduced between ranks:
    each rank keeps its own unsharded sums, the optimizer steps on what reaches the
    sharded parameters, and the ranks no longer train one model, silently.

    ## Example
    ```python
    model.set_requires_gradient_sync(False)
    loss.backward()
    optimizer.step()
    ```

    ## Use instead
    ```python
    model.set_requires_gradient_sync((step + 1) % accum == 0)
    loss.backward()
    ```

    ## Fix safety
    No automatic fix: which micro-step ends the accumulation is the script's choice.
    """

    CODE = "FSD123"
    NAME = "gradient-sync-off"
    MESSAGE = (
        "`{call}` and no call turns it back on: the gradients of sharded `{root}` are never reduced between ranks"
    )
    TRIGGERS = ("set_requires_gradient_sync",)
    VALID = (
        Valid(_HEAD + _LOOP.format(sync="model.set_requires_gradient_sync((i + 1) % 4 == 0)")),
        Valid(_HEAD + "for i, x in enumerate(loader):\n    model.set_requires_gradient_sync(False)\n"
              "    model(x).sum().backward()\n    if (i + 1) % 4 == 0:\n        model.set_requires_gradient_sync(True)\n"
              "        opt.step()\n"),
        Valid("import torch\nmodel = Net()\nmodel.set_requires_gradient_sync(False)\n"),  # not sharded
    )
    INVALID = (
        Invalid(_HEAD + _LOOP.format(sync="model.set_requires_gradient_sync(False)"), line=7),
        Invalid(_HEAD + "model.set_requires_gradient_sync(requires_gradient_sync=False)\n" + _LOOP.format(sync="pass"),
                line=6),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.uses_fully_shard:
            return
        calls = []
        for call in ctx.nodes(cst.Call):
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value == "set_requires_gradient_sync" and call.args:
                calls.append(call)
        turned_on = {_code(c.func.value) for c in calls if not _false(c.args[0].value)}
        for call in calls:
            receiver = call.func.value
            if not _false(call.args[0].value) or _code(receiver) in turned_on:
                continue
            root = shards.sharded_module(receiver, call)
            if root is not None:
                yield call, {"call": _code(call), "root": root}, None


def _false(expr) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "False"


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
