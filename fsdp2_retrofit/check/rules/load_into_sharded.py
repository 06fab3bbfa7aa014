"""FSD112 load-into-sharded."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.syntax.torch_api import TORCH_LOAD
from . import Invalid, Rule, Valid

_HEAD = "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"


class LoadIntoSharded(Rule):
    """Checks for `load_state_dict(torch.load(...))` into a sharded model.

    ## What it does
    Flags `model.load_state_dict(x)` after `fully_shard(model)` when `x` comes from
    `torch.load` (directly, through a variable, or an entry of a loaded dict).

    ## Why is this bad?
    The file holds plain tensors (a full state dict) while the sharded model's
    parameters are DTensors holding one shard each. Copying full tensors into shards
    fails on shapes or, with `strict=False` and assign tricks, leaves parameters that
    are no longer sharded.

    ## Example
    ```python
    fully_shard(model)
    model.load_state_dict(torch.load("model.pt"))
    ```

    ## Use instead
    Load before sharding (`model.load_state_dict(...)`, then `fully_shard(model)`), or
    into the sharded model:
    ```python
    set_model_state_dict(
        model, torch.load("model.pt", mmap=True),
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    ```
    and for DCP checkpoints `dcp.load(state, checkpoint_id=...)` followed by
    `set_model_state_dict(model, state)`.

    ## Fix safety
    No automatic fix: loading before sharding or broadcasting from rank 0 are both
    valid and the choice is the user's.
    """

    CODE = "FSD112"
    NAME = "load-into-sharded"
    MESSAGE = "`{target}.load_state_dict` of a `torch.load`ed state into sharded `{root}`: plain tensors into DTensor parameters"
    TRIGGERS = ("load_state_dict",)
    VALID = (
        Valid(_HEAD + "model.load_state_dict(torch.load('model.pt'))\nfully_shard(model)\n"),
        Valid(_HEAD + "fully_shard(model)\nstate = get_model_state_dict(model)\ndcp.load(state, checkpoint_id=p)\n"
              "set_model_state_dict(model, state)\n"),
    )
    INVALID = (
        Invalid(_HEAD + "fully_shard(model)\nmodel.load_state_dict(torch.load('model.pt'))\n", line=5),
        Invalid(_HEAD + "fully_shard(model)\nckpt = torch.load(path, map_location='cpu')\n"
                "model.load_state_dict(ckpt['model'])\n", line=6),
    )

    def check(self, ctx):
        shards = ctx.shards
        for call in ctx.nodes(cst.Call):
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "load_state_dict") or not call.args:
                continue
            root = shards.sharded_module(func.value, call)
            if root is None or not shards.is_fsdp2(root, call):
                continue
            if self._loaded(ctx, call.args[0].value, call, depth=3):
                yield call, {"target": _code(func.value), "root": root}, None

    def _loaded(self, ctx, expr, at, depth) -> bool:
        if depth == 0:
            return False
        if isinstance(expr, cst.Call):
            return bool(ctx.resolver.qnames(expr) & TORCH_LOAD)
        if isinstance(expr, cst.Subscript):
            return self._loaded(ctx, expr.value, at, depth)
        if isinstance(expr, cst.Name):
            return any(self._loaded(ctx, v, at, depth - 1) for v in ctx.shards.bound_values(expr.value, at))
        return False


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
