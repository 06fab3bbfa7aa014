"""FSD117 sharded-param-tensor."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis.param_values import ParamValues
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nimport torch.nn.functional as F\nfrom torch.distributed.fsdp import fully_shard\n"
    "model = Net()\nfully_shard(model)\n"
)
_ARITH = (cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.MatrixMultiply, cst.Power, cst.FloorDivide)


class ShardedParamTensor(Rule):
    """Checks for tensors built from sharded parameters outside forward.

    ## What it does
    Outside a `forward` method, flags:
    - `.numpy()` / `.tolist()` of a sharded module's parameter (`model.fc.weight`, a
      variable of a loop or comprehension over `model.parameters()`, or a local
      computed from one);
    - arithmetic between such a value and a plain tensor: a forward output of the
      sharded model (`loss = F.cross_entropy(model(x), y)`) or a tensor from a torch
      factory (`torch.zeros(...)`), e.g. `loss + wd * sum(p.pow(2).sum() for p in
      model.parameters())`.
    Nested functions are checked too.

    ## Why is this bad?
    Outside forward, FSDP2's parameters are DTensors, each rank holding one shard.
    `.numpy()` and `.tolist()` raise (not supported for tensor subclasses), and an
    operation mixing a DTensor with a plain tensor raises "got mixed torch.Tensor and
    DTensor": at once for a full tensor, or, for a scalar such as the penalty above
    (a `Partial` DTensor), in `backward()` (both seen on torch 2.13 with 2 ranks,
    blocks and root sharded). Only inside forward are the parameters gathered into
    plain tensors. (A root sharded alone keeps its parameters gathered from its
    forward to its backward, where such code happens to run; it is flagged anyway:
    sharding the blocks too breaks it.)

    ## Example
    ```python
    loss = F.cross_entropy(model(x), y)
    loss = loss + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())
    ```

    ## Use instead
    Compute the term inside `forward`, use the optimizer's `weight_decay`, or read the
    full values on every rank with `.full_tensor()` (a collective):
    ```python
    l2 = sum(p.pow(2).sum() for p in model.parameters()).full_tensor()
    loss = loss + 1e-4 * l2
    ```

    ## Fix safety
    No automatic fix: `.full_tensor()` is a collective every rank must join, and the
    right place for it (or for the computation) needs a person.
    """

    CODE = "FSD117"
    NAME = "sharded-param-tensor"
    MESSAGE = "{what} of sharded `{root}`'s parameters outside forward: {why}"
    TRIGGERS = ("numpy", "tolist", "parameters", "weight", "bias")
    VALID = (
        Valid(_HEAD + "w = model.fc.weight.full_tensor().numpy()\n"),
        Valid(_HEAD + "loss = F.cross_entropy(model(x), y)\n"
              "loss = loss + 1e-4 * sum(p.pow(2).sum() for p in model.parameters()).full_tensor()\n"),
        Valid(_HEAD + "ema = [p.detach().clone() for p in model.parameters()]\n"),  # DTensors both
        Valid("import torch\nmodel = Net()\nw = model.fc.weight.numpy()\n"),  # not sharded
        Valid(  # inside forward the parameters are gathered
            "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
            "class Net(nn.Module):\n    def forward(self, x):\n        return x @ self.fc.weight.T\n"
            "model = Net()\nfully_shard(model)\n"
        ),
    )
    INVALID = (
        Invalid(_HEAD + "w = model.fc.weight.detach().cpu().numpy()\n", line=6),
        Invalid(
            _HEAD + "for x, y in loader:\n    loss = F.cross_entropy(model(x), y)\n"
            "    l2 = sum(p.pow(2).sum() for p in model.parameters())\n    loss = loss + 1e-4 * l2\n"
            "    loss.backward()\n",
            line=9,
        ),
        Invalid(  # a nested function closing over the sharded model
            "import torch\nfrom torch.distributed.fsdp import fully_shard\ndef main():\n    model = Net()\n"
            "    fully_shard(model)\n    def log():\n        return [p.tolist() for n, p in model.named_parameters()]\n"
            "    log()\n",
            line=7,
        ),
    )

    def check(self, ctx):
        if not ctx.shards.uses_fully_shard:
            return
        values = ParamValues(ctx)
        for call in ctx.nodes(cst.Call):
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value in ("numpy", "tolist") and not call.args:
                if values.in_forward(call):
                    continue
                root = values.reads_params(func.value)
                if root is not None:
                    yield call, {"what": f"`.{func.attr.value}()`", "root": root,
                                 "why": "a DTensor shard has none (RuntimeError); use `.full_tensor()` on every rank "
                                 "first"}, None
        for op in ctx.nodes(cst.BinaryOperation):
            if not isinstance(op.operator, _ARITH) or values.in_forward(op):
                continue
            for mine, other in ((op.left, op.right), (op.right, op.left)):
                root = values.reads_params(mine)
                if root is None or values.plain_tensor(mine):
                    continue
                if values.plain_tensor(other) and values.reads_params(other) is None:
                    yield op, {"what": f"`{_code(op)}` mixes a plain tensor with a value", "root": root,
                               "why": "DTensor and torch.Tensor do not mix (RuntimeError here or in backward); "
                               "compute it in forward or use `.full_tensor()` on every rank"}, None
                    break


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    text = code(node)
    return text if len(text) <= 60 else text[:57] + "..."
