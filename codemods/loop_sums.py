"""loop_sums: a sum each rank builds over its part of a split DataLoader (an evaluation's loss
and correct count) is combined over the ranks right after the loop, on every rank, so that what
the script computes from it (a printed accuracy, `if acc > best:`, a returned figure) is the
single run's, and the same on every rank (analysis/loop_sums.py)."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.loop_sums import loop_sums
from fsdp2_retrofit.analysis.rank_uniform import RankUniform, ranks_part_at
from fsdp2_retrofit.rewrite.gather_sums import gather_sums
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import code


class CombineLoopSumsCommand(RetrofitStage):
    DESCRIPTION = "Sum the figures each rank adds up over its part of a split DataLoader over every rank, after the loop."
    CODE = "loop_sums"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if facts.distributed_init is None:
            return  # (not skipped by --no-reduce-logs: decisions read these sums, not only prints)
        r = facts.resolver
        uniform = RankUniform(r, {l.name for l in facts.loaders})
        for found in loop_sums(facts):
            if found.reduced or not found.sums:
                continue
            outer = ranks_part_at(found.loop, found.function, r, uniform)
            if outer is not None:
                self.refuse(
                    "FSR639", found.loop,
                    f"the sums {_names(found.sums)} of this loop over a split DataLoader would be combined over the "
                    f"ranks after it, but the loop sits under `{_test(outer)}` (line {r.line(outer)}), not known to "
                    "be the same on every rank",
                    "each rank sums its own part of the data; combining the sums is a collective every rank must "
                    "join, and under a condition each rank decides for itself the ranks that enter it would wait "
                    "for the others (a hang)",
                )
                continue
            names = [n for n, _ in found.sums]
            ranks = self.fresh_name(f"{names[0]}_ranks" if len(names) == 1 else "sums_ranks", found.function)
            self.__dict__["_visible"][id(found.function)].add(ranks)
            lines = gather_sums(ranks, found.sums, {n: n for n in names})
            editor.insert_after(found.loop, [self.stmt(line) for line in lines])
            self.add_import("torch.distributed", asname="dist")
            means = [n for n, k in found.sums if k == "mean"]
            self.change(
                found.loop,
                f"{_names(found.sums)}, summed over this rank's part of the data, "
                f"{'is' if len(names) == 1 else 'are'} summed over the ranks after the loop, on every rank"
                + (f" ({_names([(n, k) for n, k in found.sums if k == 'mean'])} a sum of batch means: divided by "
                   "the world size)" if means else ""),
                "the DistributedSampler gives each rank its own part of the loader: the figures computed from these "
                "sums (a loss or accuracy over len(loader.dataset), `if acc > best:`) are then the single run's and "
                "the same on every rank (exact where the world size divides the dataset: otherwise "
                "DistributedSampler repeats up to world_size - 1 samples to even the ranks out, counted too)",
            )
        for found in loop_sums(facts):
            if found.mixed:
                self.attention(
                    found.loop,
                    f"{', '.join(f'`{n}`' for n in found.unknown)}, summed in this loop, stays each rank's own figure "
                    "where the loop reads a split DataLoader",
                    "the loop is handed a loader the DistributedSampler splits at one call and one every rank reads "
                    "whole at another: summed over the ranks, the whole loader's figures would count world_size "
                    "times; give the loaders one treatment (or all_reduce the split one's sums yourself)",
                    differs=True,
                )
            elif found.unknown and not found.reduced:
                self.attention(
                    found.loop,
                    f"{', '.join(f'`{n}`' for n in found.unknown)}, added to in this loop over a split DataLoader, "
                    "stays each rank's own figure (of its part of the data)",
                    "the terms are not recognised as a per-sample sum, a count or a batch's mean loss (or the name "
                    "is added to elsewhere too), so they are not combined over the ranks: all_reduce them yourself "
                    "after the loop",
                    differs=True,
                )


def _names(sums) -> str:
    return ", ".join(f"`{n}`" for n, _ in sums)


def _test(stmt) -> str:
    if type(stmt) is cst.If:
        return f"if {code(stmt.test)}"
    return "try: ... except"
