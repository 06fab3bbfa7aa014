"""FSD115 flattening-optimizer."""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.analysis.closures import sharded_here
from fsdp2_retrofit.syntax.torch_api import LBFGS, ZERO_REDUNDANCY_OPTIMIZER
from . import Invalid, Rule, Valid

_HEAD = "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"
# optimizers that view all parameters (or gradients) as one flat vector, or flatten and
# partition them themselves
_WHY_LBFGS = "it flattens every gradient into one vector and line-searches on its dot products"
_WHY_ZERO = "it flattens and partitions the parameters itself (FSDP2 already shards them and the optimizer state)"
_FLATTENING = {**dict.fromkeys(LBFGS, _WHY_LBFGS), **dict.fromkeys(ZERO_REDUNDANCY_OPTIMIZER, _WHY_ZERO)}


class FlatteningOptimizer(Rule):
    """Checks for LBFGS or a flattening optimizer over sharded parameters.

    ## What it does
    Flags `torch.optim.LBFGS(...)` and `ZeroRedundancyOptimizer(...)` built over the
    parameters of a module sharded with `fully_shard` (directly, through a parameter
    group list, or inside a nested function closing over the module).

    ## Why is this bad?
    FSDP2's parameters are DTensors, each rank holding one shard. LBFGS reshapes every
    gradient into one flat vector and takes dot products of it for its directions and
    line search; `ZeroRedundancyOptimizer` flattens the parameters into buckets and
    partitions them across ranks itself. Neither is written for DTensor shards: they
    fail in the first step, or compute on each rank's shards alone and let the ranks
    take different steps.

    ## Example
    ```python
    fully_shard(model)
    optimizer = torch.optim.LBFGS(model.parameters())
    ```

    ## Use instead
    An element-wise optimizer (`SGD`, `Adam`, `AdamW`, ...), which works shard by
    shard; FSDP2 already shards the optimizer state, so `ZeroRedundancyOptimizer` is
    not needed. For LBFGS, train without sharding (or with DDP).

    ## Fix safety
    No automatic fix: the choice of optimizer changes the training.
    """

    CODE = "FSD115"
    NAME = "flattening-optimizer"
    MESSAGE = "`{func}` over the parameters of sharded `{root}`: {why}; it is not written for DTensor shards"
    TRIGGERS = ("LBFGS", "ZeroRedundancyOptimizer")
    VALID = (
        Valid(_HEAD + "fully_shard(model)\nopt = torch.optim.AdamW(model.parameters())\n"),
        Valid(_HEAD + "probe = Net()\nfully_shard(model)\nopt = torch.optim.LBFGS(probe.parameters())\n"),
        Valid("import torch\nmodel = Net()\nopt = torch.optim.LBFGS(model.parameters())\n"),  # not sharded
    )
    INVALID = (
        Invalid(_HEAD + "fully_shard(model)\nopt = torch.optim.LBFGS(model.parameters(), lr=1)\n", line=5),
        Invalid(
            _HEAD + "from torch.distributed.optim import ZeroRedundancyOptimizer\nfully_shard(model)\n"
            "groups = [{'params': model.parameters()}]\n"
            "opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW)\n",
            line=7,
        ),
        Invalid(  # a nested function closing over the sharded model
            "import torch\nfrom torch.distributed.fsdp import fully_shard\ndef main():\n    model = Net()\n"
            "    fully_shard(model)\n    def build():\n        return torch.optim.LBFGS(model.parameters())\n"
            "    opt = build()\n",
            line=7,
        ),
    )

    def check(self, ctx):
        if not ctx.shards.uses_fully_shard:
            return
        for call in ctx.nodes(cst.Call):
            names = ctx.resolver.qnames(call) & set(_FLATTENING)
            if not names:
                continue
            params = next((a.value for a in call.args if a.keyword is None or a.keyword.value == "params"), None)
            root = self._sharded_in(ctx, params, call, depth=2) if params is not None else None
            if root is not None:
                yield call, {"func": _code(call.func), "root": root, "why": _FLATTENING[sorted(names)[0]]}, None

    def _sharded_in(self, ctx, expr, at, depth) -> Optional[str]:
        """A sharded module whose parameters `expr` reads (parts, groups, names bound to them)."""
        if depth < 0:
            return None
        stack = [expr]
        while stack:
            node = stack.pop()
            if isinstance(node, (cst.Name, cst.Attribute, cst.Subscript, cst.Call)):
                found = sharded_here(ctx.shards, node, at, fsdp2=True)
                if found is not None:
                    return found[0]
            if isinstance(node, cst.Name):
                for value in ctx.shards.bound_values(node.value, at):
                    inner = self._sharded_in(ctx, value, at, depth - 1)
                    if inner is not None:
                        return inner
            stack.extend(c for c in node.children if isinstance(c, cst.CSTNode))
        return None


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
