"""Whether every rank builds the same initial weights, or rank 0's must be broadcast.

DDP copies rank 0's parameters and buffers to every rank when it wraps a model;
fully_shard does not: each rank keeps its own slice of the weights it built. Ranks
that build from different random states (no seed at all: torch seeds each process
differently; a seed that depends on the rank, directly or through a variable)
would assemble a model no single process ever had, and buffers (not sharded) would
differ outright. The shard stage then broadcasts rank 0's parameters and buffers
before fully_shard.

The build counts as seeded alike on every rank only when a `torch.manual_seed(<int
literal>)` runs before it (at module level, or earlier in the block that builds
the model) and no seed call anywhere in the script takes anything but a literal.
"""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.syntax.torch_api import ALL_SEEDS as _ALL_SEEDS, SEEDS_EVERY_DEVICE as _SEEDS_EVERY_DEVICE


def _literal_seed(call: cst.Call) -> bool:
    return len(call.args) == 1 and call.args[0].keyword is None and isinstance(call.args[0].value, cst.Integer)


def broadcast_reason(facts, model) -> Optional[str]:
    """Why `model`'s ranks may build different weights (then rank 0's are broadcast), or
    None when a literal seed set before the build makes them equal."""
    r = facts.resolver
    seeds = [c for c in r.nodes(cst.Call) if r.qnames(c) & _ALL_SEEDS]
    for call in seeds:
        if not _literal_seed(call):
            return f"the seed `{code(call)}` (line {r.line(call)}) may differ between ranks"
    build = model.top
    block_body = list(model.block.body)
    for call in seeds:
        if not r.qnames(call) & _SEEDS_EVERY_DEVICE:
            continue
        stmt = r.statement_of(call)
        if stmt in facts.module.body and (r.enclosing_function(build) is not None or r.order(stmt) < r.order(build)):
            return None  # module level, before the build (or before main() can run)
        if stmt in block_body and build in block_body and block_body.index(stmt) < block_body.index(build):
            return None
    return "no `torch.manual_seed(<literal>)` runs before the build, so each rank draws its own weights"


__all__ = ["broadcast_reason"]
