"""FSD125 broadcast-after-shard."""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.syntax.torch_api import BROADCAST
from . import Invalid, Rule, Valid

_PARAMETER_METHODS = {"parameters", "named_parameters"}  # buffers stay plain tensors: they broadcast fine
_PARAMETER_NAMES = {"weight", "bias"}
_SAME_TENSOR = {"to", "detach", "cpu", "cuda", "contiguous", "clone"}  # a copy or view of the tensor

_HEAD = "import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"
_LOOP = "for p in {params}:\n    dist.broadcast(p{suffix}, src=0)\n"


class BroadcastAfterShard(Rule):
    """Checks for `dist.broadcast` of a parameter or buffer of a module after `fully_shard` of it.

    ## What it does
    Flags `dist.broadcast(t, src)` where `t` is a parameter of a module sharded with
    `fully_shard` earlier in the function: `model.fc.weight` (or `.bias`), a loop
    variable over `model.parameters()` / `model.named_parameters()` (or a list
    unpacking them, `[*model.parameters(), *model.buffers()]`), or a name bound to
    `.data`, `.to(...)`, `.detach()` of one of these. Buffers alone are not flagged:
    fully_shard leaves them plain tensors.

    ## Why is this bad?
    After `fully_shard` each parameter is a DTensor holding this rank's shard.
    `dist.broadcast` has no sharding rule for DTensors: the call fails
    (`c10d.broadcast_.default does not have a sharding strategy registered`), and a
    broadcast of `.to_local()` would copy rank 0's shard over every other rank's
    different shard, silently. Copying rank 0's initial weights to every rank is done
    before sharding.

    ## Example
    ```python
    fully_shard(model)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    ```

    ## Use instead
    ```python
    for p in [*model.parameters(), *model.buffers()]:
        dist.broadcast(p.data, src=0)
    fully_shard(model)
    ```
    or, for weights loaded on rank 0 after sharding, `set_model_state_dict(model, sd,
    options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`.

    ## Fix safety
    No automatic fix: moving the broadcast before `fully_shard` moves it before
    whatever ran in between.
    """

    CODE = "FSD125"
    NAME = "broadcast-after-shard"
    MESSAGE = "`{call}` broadcasts {what} of `{root}` after `fully_shard` of it: a DTensor shard cannot be broadcast"
    TRIGGERS = ("broadcast",)
    VALID = (
        Valid(_HEAD + _LOOP.format(params="model.parameters()", suffix=".data") + "fully_shard(model)\n"),
        Valid(_HEAD + "fully_shard(model)\nflag = torch.zeros(1)\ndist.broadcast(flag, src=0)\n"),
        Valid("import torch\nimport torch.distributed as dist\nmodel = Net()\n"
              + _LOOP.format(params="model.parameters()", suffix="")),  # nothing sharded
        Valid(_HEAD + "other = Net()\nfully_shard(model)\n" + _LOOP.format(params="other.parameters()", suffix="")),
        Valid(_HEAD + "fully_shard(model)\n" + _LOOP.format(params="model.buffers()", suffix="")),  # plain tensors
    )
    INVALID = (
        Invalid(_HEAD + "fully_shard(model)\n" + _LOOP.format(params="model.parameters()", suffix=".data"), line=7),
        Invalid(_HEAD + "fully_shard(model)\ndist.broadcast(model.fc.weight, 0)\n", line=6),
        Invalid(  # the shape of a generated same-start broadcast, placed after the shard
            _HEAD + "fully_shard(model)\nwith torch.no_grad():\n    for t in [*model.parameters(), *model.buffers()]:\n"
            "        on_device = t.to('cpu')\n        dist.broadcast(on_device, src=0)\n        t.copy_(on_device)\n",
            line=9,
        ),
        Invalid(
            "import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
            "def main():\n    model = Net()\n    fully_shard(model)\n"
            "    for name, p in model.named_parameters():\n        dist.broadcast(p, src=0)\n",
            line=8,
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.uses_fully_shard:
            return
        for call in ctx.nodes(cst.Call):
            if not call.args or not (ctx.resolver.qnames(call) & BROADCAST):
                continue
            found = _module_of(ctx, call.args[0].value, call, depth=3)
            if found is None:
                continue
            module, what = found
            root = shards.sharded_module(module, call)
            if root is not None:
                yield call, {"call": code(call), "what": what, "root": root}, None


def _module_of(ctx, expr, at, depth: int) -> Optional[tuple]:
    """(module expression, what) when `expr` is a parameter of a module."""
    while True:  # `p.data`, `p.to(device)`, `p.detach()`: the same tensor
        if isinstance(expr, cst.Attribute) and expr.attr.value == "data":
            expr = expr.value
        elif (isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute)
              and expr.func.attr.value in _SAME_TENSOR):
            expr = expr.func.value
        else:
            break
    if isinstance(expr, cst.Attribute) and expr.attr.value in _PARAMETER_NAMES and not isinstance(expr.value, cst.Call):
        return expr.value, f"`{code(expr)}`"  # `model.fc.weight`
    if not isinstance(expr, cst.Name) or depth == 0:
        return None
    loop = _loop_over(ctx, expr.value, at)
    if loop is not None:
        for source in _iterated(loop.iter):
            if (isinstance(source, cst.Call) and isinstance(source.func, cst.Attribute)
                    and source.func.attr.value in _PARAMETER_METHODS):
                return source.func.value, f"a tensor of `{code(source)}`"
        return None
    for value in ctx.shards.bound_values(expr.value, at)[-1:]:
        return _module_of(ctx, value, at, depth - 1)
    return None


def _loop_over(ctx, name: str, at) -> Optional[cst.For]:
    """The innermost `for` around `at` whose target binds `name`."""
    for anc in ctx.resolver.ancestors(at):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return None
        if isinstance(anc, cst.For) and name in _target_names(anc.target):
            return anc
    return None


def _target_names(target) -> set:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Tuple, cst.List)):
        return {n for e in target.elements for n in _target_names(e.value)}
    return set()


def _iterated(expr):
    """The sources a `for` iterates: `m.parameters()`, the parts of `[*a, *b]`, through `enumerate(...)`."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value in (
        "enumerate", "list", "tuple", "reversed"
    ) and expr.args:
        expr = expr.args[0].value
    if isinstance(expr, (cst.List, cst.Tuple)):
        return [e.value for e in expr.elements]
    if isinstance(expr, cst.BinaryOperation):  # `list(a.parameters()) + list(a.buffers())`
        return _iterated(expr.left) + _iterated(expr.right)
    return [expr]
