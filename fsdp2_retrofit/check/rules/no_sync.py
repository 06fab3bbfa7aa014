"""FSD105 no-sync."""
from __future__ import annotations

import libcst as cst

from . import Edit, Fix, Invalid, Rule, Valid

_HEAD = "from torch.distributed.fsdp import fully_shard\nmodel = Net()\nfully_shard(model)\n"


class NoSync(Rule):
    """Checks for DDP/FSDP1 gradient-sync switches on an FSDP2 module.

    ## What it does
    Flags `model.no_sync()` and assignments to `model.require_backward_grad_sync` when
    `model` is sharded with `fully_shard`.

    ## Why is this bad?
    These belong to DistributedDataParallel and FSDP1. An FSDP2 module has no
    `no_sync` (an AttributeError at the first accumulation step), and setting
    `require_backward_grad_sync` on it is an ordinary attribute that nothing reads:
    gradients are still reduce-scattered on every micro-batch.

    ## Example
    ```python
    model.require_backward_grad_sync = is_last_micro_batch
    loss.backward()
    ```

    ## Use instead
    ```python
    model.set_requires_gradient_sync(is_last_micro_batch)
    loss.backward()
    ```

    ## Fix safety
    The fix for the assignment is safe: `set_requires_gradient_sync(value)` is FSDP2's
    switch with the same meaning. `with model.no_sync():` has no automatic fix: call
    `model.set_requires_gradient_sync(False)` before the micro-batches that should not
    reduce, and `set_requires_gradient_sync(True)` before the last one.
    """

    CODE = "FSD105"
    NAME = "no-sync"
    MESSAGE = "`{what}` is not FSDP2 API; use `{target}.set_requires_gradient_sync(...)`"
    TRIGGERS = ("no_sync", "require_backward_grad_sync")
    VALID = (
        Valid(_HEAD + "model.set_requires_gradient_sync(step % 4 == 3)\n"),
        Valid("import torch\nddp = torch.nn.parallel.DistributedDataParallel(net)\nwith ddp.no_sync():\n    pass\n"),
        Valid(  # a branch that runs only where the module is not FSDP2's (DDP chosen elsewhere)
            "from torch.distributed.fsdp import FSDPModule, fully_shard\nfrom torch.nn.parallel import "
            "DistributedDataParallel as DDP\nmodel = Net()\nif sharded:\n    fully_shard(model)\nelse:\n    model = DDP(model)\n"
            "if isinstance(model, FSDPModule):\n    model.set_requires_gradient_sync(last)\n"
            "elif isinstance(model, DDP):\n    with model.no_sync():\n        loss.backward()\n"
            "if isinstance(model, DDP):\n    model.require_backward_grad_sync = last\n"
        ),
    )
    INVALID = (
        Invalid(_HEAD + "with model.no_sync():\n    loss.backward()\n", line=4),
        Invalid(
            _HEAD + "model.require_backward_grad_sync = (step + 1) % accum == 0\n",
            line=4,
            fixed=_HEAD + "model.set_requires_gradient_sync((step + 1) % accum == 0)\n",
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        for call in ctx.nodes(cst.Call):
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value == "no_sync":
                root = shards.sharded_module(func.value, call)
                if root is not None and shards.is_fsdp2(root, call):
                    yield call, {"what": f"{_code(func.value)}.no_sync()", "target": _code(func.value)}, None
        assigns = [(a, [t.target for t in a.targets]) for a in ctx.nodes(cst.Assign)]
        assigns += [(a, [a.target]) for a in ctx.nodes(cst.AnnAssign) if a.value is not None]
        for assign, targets in assigns:
            for target in targets:
                if not (isinstance(target, cst.Attribute) and target.attr.value == "require_backward_grad_sync"):
                    continue
                root = shards.sharded_module(target.value, assign)
                if root is None or not shards.is_fsdp2(root, assign):
                    continue
                owner = _code(target.value)
                fix = None
                if isinstance(assign, cst.Assign) and len(targets) == 1:
                    value = assign.value.with_changes(lpar=[], rpar=[]) if assign.value.lpar else assign.value
                    new = cst.Expr(
                        cst.Call(cst.Attribute(target.value, cst.Name("set_requires_gradient_sync")), [cst.Arg(value)])
                    )
                    fix = Fix(f"Call `{owner}.set_requires_gradient_sync(...)`", [Edit(assign, new)])
                yield assign, {"what": f"{owner}.require_backward_grad_sync = ...", "target": owner}, fix


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
