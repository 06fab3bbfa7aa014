"""FSD109 shard-container."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.syntax.names import attr_path
from fsdp2_retrofit.syntax.torch_api import BARE_CONTAINERS as _BARE
from . import Invalid, Rule, Valid

_NET = (
    "import torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
    "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.layers = nn.ModuleList([Block() for _ in range(4)])\n"
    "        self.head = nn.Linear(8, 8)\n"
    "model = Net()\n"
)


class ShardContainer(Rule):
    """Checks for `fully_shard` of an `nn.ModuleList` or `nn.ModuleDict`.

    ## What it does
    Flags `fully_shard(x)` where `x` is a `ModuleList` or `ModuleDict`: built as one in
    the same script, an attribute that the model's class (in the script or a
    sibling module) assigns one to (any `ModuleDict`/`ModuleList`, or an instance of a
    class of the project built on one), or the value of a function of a project module
    whose every `return` builds one.

    ## Why is this bad?
    FSDP2 all-gathers a unit's parameters in a hook on the unit's `forward`. Containers
    are never called: the model iterates them and calls each block. The hooks never
    fire, so the blocks run on their local shards, or stay all-gathered for the whole
    step (no memory saving).

    ## Example
    ```python
    fully_shard(model.layers)
    ```

    ## Use instead
    ```python
    for layer in model.layers:
        fully_shard(layer)
    ```

    ## Fix safety
    No automatic fix; shard each child (the loop above), then the root.
    """

    CODE = "FSD109"
    NAME = "shard-container"
    MESSAGE = "`{target}` is a {kind}, which has no forward: FSDP2's hooks never fire; shard its children"
    VALID = (
        Valid(_NET + "for layer in model.layers:\n    fully_shard(layer)\nfully_shard(model)\n"),
        Valid(_NET + "fully_shard(model.head)\n"),
    )
    INVALID = (
        Invalid(_NET + "fully_shard(model.layers)\nfully_shard(model)\n", line=9),
        Invalid("import torch\nfrom torch.distributed.fsdp import fully_shard\n"
                "blocks = torch.nn.ModuleList([Block(), Block()])\nfully_shard(blocks)\n", line=4),
    )

    def check(self, ctx):
        for site in ctx.shards.sites:
            if site.legacy or not site.direct or not site.call.args:
                continue
            target = site.call.args[0].value
            kind = self._container_kind(ctx, target, site.call)
            if kind:
                yield site.call, {"target": _code(target), "kind": kind}, None

    def _container_kind(self, ctx, target, at):
        if isinstance(target, cst.Name):
            for value in ctx.shards.bound_values(target.value, at):
                names = ctx.resolver.qnames(value) if isinstance(value, cst.Call) else set()
                if names & _BARE:
                    return sorted(names & _BARE)[0].rsplit(".", 1)[-1]
                for q in sorted(names):
                    kind = ctx.classes().container_class_kind(q) or _returned_kind(ctx, q)
                    if kind:
                        return kind
            return None
        path = attr_path(target)
        if not path or len(path) < 2:
            return None
        owner_class = self._class_of(ctx, path[0], at)
        if owner_class is None:
            return None
        for container in ctx.classes().block_containers(owner_class):
            if container.path == tuple(path[1:]) and container.kind in ("ModuleList", "ModuleDict"):
                return container.kind
        # any ModuleDict/ModuleList attribute (not only repeated blocks), its class in any module read
        return ctx.classes().container_kind(owner_class, path[1:])

    def _class_of(self, ctx, name: str, at):
        for value in ctx.shards.bound_values(name, at):
            call = value
            while isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute):
                call = call.func.value  # Net().to(device)
            if isinstance(call, cst.Call):
                for q in sorted(ctx.resolver.qnames(call)):
                    if ctx.classes().is_module_class(q):
                        return q
        return None


def _returned_kind(ctx, qname: str):
    """"ModuleDict"/"ModuleList" when every `return` of the project function `qname` (the
    script's or a sibling module's, through re-exports) builds one (or a class built on one)."""
    from fsdp2_retrofit.analysis.module_values import ModuleValues
    from fsdp2_retrofit.analysis.returns import own_returns

    registry = ctx.classes()
    bound = ModuleValues(registry).bound(qname)
    if bound is None or bound.function is None or bound.namer is None:
        return None
    kinds = set()
    for ret in own_returns(bound.namer.resolver, bound.function):
        value = ret.value
        kinds.add(registry.container_class_kind(bound.namer.of(value)) if isinstance(value, cst.Call) else None)
    return kinds.pop() if len(kinds) == 1 else None


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
