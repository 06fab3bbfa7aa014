"""optimizer: build each optimizer after the model it trains is sharded."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.syntax.names import assigned_names, names_in
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor


class MoveOptimizerCommand(RetrofitStage):
    DESCRIPTION = "Move optimizers (and what depends on them) after fully_shard of their model."
    CODE = "optimizer"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        shard_stmts = facts.root_shard
        for opt in facts.optimizers:
            anchors = [shard_stmts.get(name) for name in opt.models]
            if not anchors or any(a is None for a in anchors):
                continue
            body = list(opt.block.body)
            if any(a not in body for a in anchors) or opt.stmt not in body:
                continue
            last = max(body.index(a) for a in anchors)
            # the optimizer, and the lists of parameters it is fed from, built before sharding
            early = [s for s in [*opt.feeders, opt.stmt] if s in body and body.index(s) <= last]
            if not early:
                continue
            moved = set(early)
            bound = set().union(*(assigned_names(s) for s in early))
            for later in body[min(body.index(s) for s in early) + 1 : last + 1]:
                if later not in moved and later not in anchors and names_in(later) & bound:
                    moved.add(later)
                    bound |= assigned_names(later)
            moved = sorted(moved, key=body.index)
            for stmt in moved:
                editor.move_after(stmt, body[last])
            self.change(
                opt.stmt,
                f"build `{opt.name}` after fully_shard({', '.join(opt.models)})"
                + (f" (with {len(moved) - 1} statement(s) that use it)" if len(moved) > 1 else ""),
                "fully_shard replaces the parameters with DTensor shards",
                "an optimizer built before sharding holds the old tensors: the model silently never updates",
            )
