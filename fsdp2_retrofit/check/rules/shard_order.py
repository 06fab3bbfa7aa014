"""FSD104 shard-order."""
from __future__ import annotations

import libcst as cst

from . import Invalid, Rule, Valid

_HEAD = "from torch.distributed.fsdp import fully_shard\nmodel = Net()\n"


class ShardOrder(Rule):
    """Checks for a module sharded before its submodules.

    ## What it does
    Flags `fully_shard(model)` when a `fully_shard` of one of `model`'s parts (its
    blocks) comes after it in the same function. Not when the two are on the two sides
    of one `if`/`else` (`if fine: fully_shard(self.moe) else: fully_shard(self.moe.shared)`):
    alternatives, never both run.

    ## Why is this bad?
    `fully_shard` groups every parameter not already in a unit below it into one unit.
    Sharding the root first puts all parameters into the root's unit, so the block
    units shard nothing: the whole model is all-gathered at once (no memory saving),
    or the later calls fail on parameters that are already DTensors.

    ## Example
    ```python
    fully_shard(model)
    for block in model.blocks:
        fully_shard(block)
    ```

    ## Use instead
    ```python
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    ```

    ## Fix safety
    No automatic fix; move the root's `fully_shard` after its blocks (bottom-up).
    """

    CODE = "FSD104"
    NAME = "shard-order"
    MESSAGE = "`{root}` is sharded before its submodules (line {line}): shard blocks first, then the root"
    VALID = (
        Valid(_HEAD + "for block in model.blocks:\n    fully_shard(block)\nfully_shard(model)\n"),
        Valid(_HEAD + "fully_shard(model)\n"),
        Valid(  # two alternatives: the root (moe) in one branch, its part in the other
            _HEAD + "if fine:\n    fully_shard(model.moe)\nelse:\n    fully_shard(model.moe.shared)\nfully_shard(model)\n"
        ),
    )
    INVALID = (
        Invalid(_HEAD + "fully_shard(model)\nfor block in model.blocks:\n    fully_shard(block)\n", line=3),
        Invalid(_HEAD + "fully_shard(model, mesh=mesh)\nfully_shard(model.encoder, mesh=mesh)\n", line=3),
        Invalid(  # one loop variable for two models: the second loop does not hide the first's blocks
            _HEAD + "fully_shard(model)\nfor m in model.blocks:\n    fully_shard(m)\n"
            "for m in head.blocks:\n    fully_shard(m)\nfully_shard(head)\n",
            line=3,
        ),
    )

    def check(self, ctx):
        sites = [s for s in ctx.shards.sites if not s.legacy and s.direct]
        for root_site in sites:
            if not root_site.whole:
                continue
            parts = [
                s for s in sites
                if s.root == root_site.root and not s.whole and s.scope is root_site.scope and s.order > root_site.order
                and not _exclusive(ctx.resolver, s.call, root_site.call)
            ]
            if parts:
                first = min(parts, key=lambda s: s.order)
                yield root_site.call, {"root": root_site.root, "line": str(ctx.resolver.line(first.call))}, None


def _sides(resolver, node):
    """{id(if): "body" | "orelse"} for each `if` (and conditional expression) around `node`."""
    out = {}
    child = node
    for above in resolver.ancestors(node):
        if isinstance(above, (cst.If, cst.IfExp)):
            out[id(above)] = "body" if child is above.body else "orelse" if child is above.orelse else "test"
        child = above
    return out


def _exclusive(resolver, a, b) -> bool:
    """`a` and `b` are on the two sides of one `if`/`else` (or `x if c else y`): never both run."""
    sa, sb = _sides(resolver, a), _sides(resolver, b)
    return any(side != sb[key] and "test" not in (side, sb[key]) for key, side in sa.items() if key in sb)
