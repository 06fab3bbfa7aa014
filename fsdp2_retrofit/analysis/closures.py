"""Sharded modules seen from nested functions: a closure variable counts as sharded
when the function around it sharded the module before defining the nested one.

ShardFacts answers "is this expression a sharded module here?" within one function
(plus module-level models and received arguments); the check rules that must look
inside closures ask `sharded_here`, which climbs to the enclosing definitions.
"""
from __future__ import annotations

from typing import Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import parameter_names


def sharded_here(
    shards, expr: cst.BaseExpression, at: cst.CSTNode, fsdp2: bool = True, root_sharded: bool = False
) -> Optional[Tuple[str, cst.CSTNode]]:
    """(root, the place its sharding is in effect) when `expr` is a sharded module or
    a part of one at `at` (with `fsdp2`, sharded by fully_shard, not FSDP1; with
    `root_sharded`, the root itself, not only some of its blocks), climbing out of
    nested functions that close over the root without rebinding it."""
    found = shards.part(expr, at)
    if found is None:
        return None
    root, anchor = found[0], at
    while True:
        name = shards.sharded_module(expr, anchor) if anchor is at else (
            root if shards.sites_for(root, anchor) else None
        )
        if name is not None and (not fsdp2 or shards.is_fsdp2(name, anchor)) and (
            not root_sharded or any(site.whole for site in shards.sites_for(name, anchor))
        ):
            return name, anchor
        fn = shards.scope_of(anchor)
        if fn is None or shards._binds(fn, root) or root.startswith("self.") or root in parameter_names(fn):
            return None
        anchor = fn
