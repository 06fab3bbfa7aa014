"""batch_draws: split the batches a script draws itself (no DataLoader) between the ranks."""
from __future__ import annotations

from typing import List

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.batch_size import shaped_in_scope, short_code
from fsdp2_retrofit.analysis.batch_draws import BatchCall, PositionCounter, RandomDraw, SliceLoop, hand_drawn_batches
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

SAME_DATA = "left as is, so after the retrofit every rank trains on the same batches"
HINT = ("draw the batch in a function that binds `ix = torch.randint(high, (B,))` and returns tensors indexed by "
        "it (`torch.stack([data[i:i + T] for i in ix])`), or split the batches by dist.get_rank() / "
        "dist.get_world_size() yourself, or use a DataLoader with DistributedSampler")
SLICE_HINT = ("cut the batches as `data[k * B:(k + 1) * B]` in `for k in range(rows // B):` and read k nowhere "
              "else, or split the batches by dist.get_rank() / dist.get_world_size() yourself, or use a DataLoader "
              "with DistributedSampler")
KEEP_NOTE = "# --keep-global-batch: each rank keeps 1/world_size of every batch; the global batch stays as written."
SLICE_NOTE = ("# every rank drew the same {batch} batch: each trains on its 1/world_size of the rows")


class SplitDrawnBatchesCommand(RetrofitStage):
    DESCRIPTION = ("Give each rank its part of the batches a script draws itself (torch.randint, a position counter, "
                   "slices in a counted loop).")
    CODE = "batch_draws"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        found = hand_drawn_batches(facts)
        for node, why, _ in found.slice_flags:
            self.attention(node, f"no DataLoader: {why}; {SAME_DATA}", SLICE_HINT, differs=True)
        for loop in found.slice_loops:
            self._split_loop(loop, facts, editor)
        if not found.found:
            return
        for node, why in found.unclear:
            self.attention(node, f"no DataLoader: {why}; {SAME_DATA}", HINT, differs=True)
        keep = self.options.keep_global_batch
        for draw in found.draws:
            calls = self._training_calls(draw, found.calls)
            if calls is None or self._before_group(draw, found.calls, facts):
                continue
            if keep and self._shaped_by_global_batch(
                    draw.size, [c.stmt for c in calls], f"`{code(draw.draw)}` draws (line {self.line(draw.draw)})"):
                continue
            if found.seeds:
                node, why = found.seeds[0]
                self.attention(
                    draw.draw,
                    f"no DataLoader: `{code(draw.draw)}` draws the batch, but {why}: each rank draws batches of "
                    "its own, not the single run's; left as is",
                    "split the single run's batch only where every rank draws the same one: seed with a value "
                    "every rank shares (`torch.manual_seed(args.seed)`), the rewrite then keeps each rank's rows",
                    differs=True,
                )
                continue
            if not keep:
                size = draw.size
                operand = code(size) if _product(size) else f"({code(size)})"
                self.add_import("torch.distributed", asname="dist")
                editor.replace_expression(size, lambda _old, text=operand: self.expr(f"{text} * dist.get_world_size()"))
                self.change(
                    draw.draw,
                    f"`{code(draw.draw)}` draws world_size x {code(size)} indices, the same on every rank (one seed "
                    "on every rank); each training call keeps its rank's rows",
                    "the per-rank batch stays as written: the global batch is world_size x larger, the batch "
                    "the single run draws at that size",
                    "drawn separately per rank from one seed, every rank would train on the same batch",
                )
            for call in calls:
                self._keep_rows(call, facts, editor, keep)
        for counter in found.counters:
            calls = self._training_calls(counter, found.calls, at_calls=keep)
            if calls is None or self._before_group(counter, found.calls, facts):
                continue
            if keep:
                for call in calls:
                    self._keep_rows(call, facts, editor, keep)
            else:
                self._stride(counter, editor)

    def _training_calls(self, source, calls: List[BatchCall], at_calls: bool = True):
        """The training calls of `source`; None where none trains or, when the split is made at the
        calls (`at_calls`), where one call does not bind its tensors to names or may be either
        training or evaluation (each such call flagged at its line)."""
        mine = [c for c in calls if c.source is source and c.training]
        if not at_calls:
            return mine or None
        loose = [c for c in mine if not c.targets]
        for call in loose:
            self.attention(
                call.call,
                f"no DataLoader: the batch of `{code(call.call)}` is used where it is drawn, not bound to names "
                f"(`x, y = {code(call.call)}`); {SAME_DATA}",
                f"bind the tensors first (`x, y = {code(call.call)}`, then use x and y): the rewrite then keeps "
                "each rank's rows of the batch every rank draws",
                differs=True,
            )
        unknown = [c for c in calls if c.source is source and c.training is None]
        for call in unknown:
            self.attention(
                call.call,
                f"no DataLoader: the rewrite cannot tell whether `{code(call.call)}` draws a batch for training "
                f"(no backward() in its function) or for evaluation (no torch.no_grad() around it); {SAME_DATA}",
                "call it where the training step calls backward(), or under `torch.no_grad()` for evaluation: the "
                "rewrite then keeps each rank's rows of a training batch and the whole batch for evaluation",
                differs=True,
            )
        return mine if mine and not loose and not unknown else None

    def _shaped_by_global_batch(self, size, stmts, source: str) -> bool:
        """--keep-global-batch: code that trains on the batch (in the functions of `stmts`) also shapes
        tensors by `size`, the global batch, where each rank now holds 1/world_size of the rows
        (flagged, left as is)."""
        text = code(size)
        shaped = [c for stmt in stmts for c in shaped_in_scope(self.facts.resolver, stmt, text)]
        for call in shaped[:1]:
            self.attention(
                call,
                f"no DataLoader: --keep-global-batch: `{short_code(call)}` is shaped by `{text}`, the size of the "
                f"batch {source}, the global batch where each rank would hold 1/world_size of the rows; {SAME_DATA}",
                "shape by the batch's own size (`x.size(0)`), or run without --keep-global-batch (each rank then "
                "keeps a batch of the size as written)",
                differs=True,
            )
        return bool(shaped)

    def _before_group(self, source, calls: List[BatchCall], facts: ScriptFacts) -> bool:
        """A call of `source` runs before the process group exists (flagged): its rank is not known there."""
        early = [c for c in calls if c.source is source and self.before_group(c.stmt, facts)]
        for call in early[:1]:
            self._early(call.call, f"`{code(call.call)}` draws a batch")
        return bool(early)

    def _early(self, node, what: str) -> None:
        self.attention(
            node,
            f"no DataLoader: {what} before the process group starts, where the rank is not known; {SAME_DATA}",
            "draw the first batch after the model is built (the process group starts before the build)",
            differs=True,
        )

    def _keep_rows(self, call: BatchCall, facts: ScriptFacts, editor: StatementEditor, keep: bool) -> None:
        """After `x, y = get_batch(...)`: each rank keeps its rows of the batch every rank drew."""
        world, rank = "dist.get_world_size()", "dist.get_rank()"
        self.add_import("torch.distributed", asname="dist")
        names = call.targets
        new = []
        first = names[0]
        if keep:  # the batch size as written is the global batch
            new.append(self.stmt(
                f'assert {first}.size(0) % {world} == 0, "the batch size must divide by the number of ranks"\n'))
        new.extend(self.stmt(f"{n} = {n}.chunk({world})[{rank}]\n") for n in names)
        note = SLICE_NOTE.format(batch="global" if keep else "world_size x larger")
        new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(note))])
        editor.insert_after(call.stmt, new)
        self.change(
            call.stmt,
            f"`{', '.join(names)}` keep the rank's 1/world_size of the rows of `{code(call.call)}`"
            + (" (the batch size as written stays the global batch; it must divide by the world size)" if keep
               else ""),
            "every rank draws the same batch; its rows, split by rank, are the single run's batch at "
            + ("the same global batch" if keep else "world_size x the batch size"),
            "without it every rank trains on the same batch",
        )

    def _stride(self, counter: PositionCounter, editor: StatementEditor) -> None:
        """`self.pos` stays the global position: rank r reads at `self.pos + r * K`, the counter
        advances by `world_size * K`, and the reset test asks whether the last rank's read fits."""
        step = counter.advance.value
        text = code(step) if _product(step) else f"({code(step)})"
        pos = f"self.{counter.attr}"
        self.add_import("torch.distributed", asname="dist")
        start = self.fresh_name("start", counter.method)
        read_stmt = self.facts.resolver.statement_of(counter.reads[0])
        editor.insert_before(read_stmt, [self.stmt(
            f"{start} = {pos} + dist.get_rank() * {text}  # this rank's part of the global batch\n")])
        for read in counter.reads:
            editor.replace_expression(read, lambda _old: cst.Name(start))
        editor.replace_expression(step, lambda _old: self.expr(f"{text} * dist.get_world_size()"))
        for check in counter.checks:  # the last rank reads furthest
            editor.replace_expression(check, lambda _old: self.expr(f"({pos} + (dist.get_world_size() - 1) * {text})"))
        cls = counter.cls.name.value
        self.change(
            counter.advance,
            f"`{pos}` of {cls} stays the global position: rank r reads at `{pos} + r * {text}`, it advances by "
            f"world_size x {text}" + (", and the reset test asks whether the last rank's read fits"
                                      if counter.checks else ""),
            "the ranks read consecutive parts of one global batch: the per-rank batch stays as written, the "
            "global batch is world_size x larger, the single run's at that batch size (evaluation instances of "
            f"{cls} read their rank's part too)",
            "without it every rank trains on the same batch",
        )

    def _split_loop(self, found: SliceLoop, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`for k in range(N):` slicing `data[k * B:(k + 1) * B]`: by default each rank runs the
        batches k = rank, rank + W, ... (every rank N // W of them); with --keep-global-batch
        every rank runs every k and keeps its 1/world_size of each batch's rows."""
        loop = found.loop
        index, size, count = code(loop.target), code(found.size), code(found.count)
        if self.before_group(loop, facts):
            self._early(loop, f"`for {index} in {code(loop.iter)}` slices the batches")
            return
        keep = self.options.keep_global_batch
        where = f"the batches `for {index} in {code(loop.iter)}` slices ({index} * {size} up to ({index} + 1) * {size})"
        if keep and self._shaped_by_global_batch(found.size, [loop], where):
            return
        self.add_import("torch.distributed", asname="dist")
        world, rank = "dist.get_world_size()", "dist.get_rank()"
        b = size if _product(found.size) else f"({size})"
        if not keep:
            n = count if _floor_chain(found.count) else f"({count})"
            func = code(loop.iter.func)
            strided = f"{func}({rank}, {n} // {world} * {world}, {world})"
            editor.replace_expression(loop.iter, lambda _old: self.expr(strided))
            self.change(
                loop,
                f"`for {index} in {code(loop.iter)}` runs the batches {index} = rank, rank + world_size, ... on each "
                f"rank, every rank {count} // world_size of them",
                "the per-rank batch stays as written: a step of the ranks together is world_size consecutive batches, "
                f"the single run's batch at world_size x {size}; every rank runs the same number of steps (FSDP2's "
                "collectives pair them)",
                "without it every rank trains on the same batches",
            )
        else:
            guard = self.stmt(f'assert {b} % {world} == 0, "the batch size must divide by the number of ranks"\n')
            note = cst.EmptyLine(comment=cst.Comment(KEEP_NOTE))
            editor.insert_before(loop, [guard.with_changes(leading_lines=[note])])
            for stmt, lower, upper in found.named:
                part = f"{lower} + {b} * {rank} // {world}, {lower} + {b} * ({rank} + 1) // {world}"
                editor.insert_after(stmt, [self.stmt(f"{lower}, {upper} = {part}\n")])
            for piece in found.inline:
                low = code(piece.lower)
                editor.replace_expression(piece.lower, lambda _old, t=f"{low} + {b} * {rank} // {world}": self.expr(t))
                editor.replace_expression(piece.upper,
                                          lambda _old, t=f"{low} + {b} * ({rank} + 1) // {world}": self.expr(t))
            self.change(
                loop,
                f"each batch `for {index} in {code(loop.iter)}` slices keeps the rank's 1/world_size of its rows "
                f"({size} stays the global batch; it must divide by the world size)",
                "every rank runs every batch; its rows, split by rank, are the single run's batch",
                "without it every rank trains on the same batches",
            )
        for total in found.sums:
            name = code(total.target)
            mine = ("this rank's part of each batch" if keep
                    else f"the batches of this rank only ({count} // world_size of them)")
            self.attention(
                total,
                f"`{name}` adds up {mine}: read after the loop it is this rank's figure, not the single run's",
                "the training is the single run's; to print the single run's figure, all_reduce it over the ranks "
                "(and divide by the world size where it is a mean of batch losses)",
            )


def _floor_chain(expr) -> bool:
    """`expr // W * W` reads as `(expr // W) * W`: a name, a call, a number, or `*`, `/`, `//`, `%` of them."""
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Integer, cst.Call, cst.Subscript)) or expr.lpar:
        return True
    return (isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Multiply, cst.Divide,
                                                                                  cst.FloorDivide, cst.Modulo))
            and _floor_chain(expr.left) and _floor_chain(expr.right))


def _product(expr) -> bool:
    """`expr` is a name, a number or a product of them (`B * T`): `r * B * T` reads as `r * (B * T)`."""
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Integer)) and not expr.lpar:
        return True
    return (isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply) and not expr.lpar
            and _product(expr.left) and _product(expr.right))


__all__ = ["SplitDrawnBatchesCommand"]
