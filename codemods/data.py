"""data: give every training DataLoader a DistributedSampler, and set its epoch."""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.analysis import LoaderSite, ScriptFacts, code
from fsdp2_retrofit.analysis.batch_size import (
    PARTIAL_LAST_BATCH,
    batch_shaped_calls,
    batch_size_readers,
    drops_last,
    nominal_batch_size,
    short_code,
)
from fsdp2_retrofit.analysis.closures import functions_reading
from fsdp2_retrofit.analysis.batch_draws import hand_drawn_batches
from fsdp2_retrofit.analysis.data import pass_in_while, unfollowed_loaders
from fsdp2_retrofit.analysis.loader_kwargs import KwargsBatchSize, batch_size_through
from fsdp2_retrofit.analysis.loops import steps_outside_loops
from fsdp2_retrofit.analysis.sibling_loaders import sibling_loaders
from fsdp2_retrofit.syntax.names import iterated_name, names_in, walk
from fsdp2_retrofit.rewrite.edit import with_keyword, without_entry, without_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

from .data_siblings import SiblingLoaderEdits, replace_dataset

BATCH_NOTE = "# The per-rank batch stays as written: the global batch is now world_size x larger."
KEEP_NOTE = "# --keep-global-batch: each rank reads 1/world_size of the batch; the global batch stays as written."


def _sampled(call: cst.Call, sampler: str, dataset: Optional[cst.BaseExpression],
             batch: Optional[cst.BaseExpression]) -> cst.Call:
    """A DataLoader call reading through `sampler` (its shuffle dropped; its dataset
    and per-rank batch size replaced where given)."""
    call = without_keyword(without_keyword(call, "shuffle"), "sampler")
    if dataset is not None:
        call = replace_dataset(call, dataset)
    if batch is not None:
        call = _replace_batch_size(call, batch)
    return with_keyword(call, "sampler", cst.Name(sampler))


class DistributeDataCommand(SiblingLoaderEdits, RetrofitStage):
    DESCRIPTION = "Shard the training data across ranks with DistributedSampler and set_epoch."
    CODE = "data"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        training = [l for l in facts.loaders if l.trains]
        elsewhere = sibling_loaders(facts.resolver, facts.classes) if not training and facts.loops else []
        for found, why in self._distribute_elsewhere(elsewhere, facts, editor):
            self.attention(
                found.call,
                f"the DataLoader comes from {found.function}() of {found.file} (its line {found.line}), left as it "
                f"is there ({why}): it gets no DistributedSampler, so every rank reads all of it (if it feeds "
                "training, every rank trains on the same batches)",
                "give that DataLoader `sampler=DistributedSampler(dataset, shuffle=...)` in place of `shuffle=`, "
                "and call `loader.sampler.set_epoch(epoch)` at the start of each epoch",
                differs=True,
            )
        # batches the script draws itself (torch.randint, a position counter, slices in a counted loop): the
        # batch_draws stage's, which splits them or says why not
        drawn = hand_drawn_batches(facts)
        loops = [l for l in facts.loops if not drawn.handles(l.node)]
        if not training and loops and not facts.loaders and not elsewhere and not drawn.found:
            self.attention(
                loops[0].node,
                "no DataLoader: the batches do not come from a sampler this tool can shard",
                "after the retrofit every rank trains on the same data; split the batches by "
                "dist.get_rank() / dist.get_world_size() or use a DataLoader with DistributedSampler",
                differs=True,
            )
        self._steps_without_loader(facts)
        self._unfollowed(tree, facts, training)
        for loader in facts.loaders:
            if not loader.trains and not loader.returned:
                self.attention(
                    loader.stmt,
                    f"`{loader.name}` is not read by a loop the rewrite recognises as training: left as is "
                    "(every rank reads all of it)",
                    "right for evaluation (shard it and all-reduce the metric to save time); if it feeds "
                    "training, every rank trains on the same batches: give it a DistributedSampler",
                )
        for loader in training:
            if loader.sampler is not None and loader.sampler.kind == "other":
                self.refuse(
                    "FSR901",
                    loader.sampler.expr,
                    f"`{loader.name}` trains through `{code(loader.sampler.expr)}`, which has no distributed "
                    "counterpart the rewrite knows",
                    "a batch sampler, a subset, weighted or custom sampler draws indices of the whole dataset: "
                    "every rank would train on the same batches",
                    "split its indices by rank yourself (e.g. indices[rank::world_size]), or use shuffle=True / "
                    "RandomSampler so the rewrite can put a DistributedSampler in its place",
                )
            if loader.sampler is not None and loader.sampler.kind in ("distributed", "per_rank"):
                continue
            if self._distribute_shared_helper(loader, facts, editor):
                continue  # the helper of this file that builds it builds a validation loader too
            self._distribute(loader, facts, editor, several=len(training) > 1)

    def _steps_without_loader(self, facts: ScriptFacts) -> None:
        """An optimizer step no loop repeats (a one-off step at module level): its batch
        comes from no DataLoader the rewrite shards, so the ranks step on whatever data each
        holds. Flagged once, at the first such step (a step inside a loop is the loop's)."""
        steps = steps_outside_loops(facts.resolver, facts.optimizer_names)
        if not steps:
            return
        more = f" (and {len(steps) - 1} more)" if len(steps) > 1 else ""
        self.attention(
            steps[0],
            f"`{code(steps[0])}` steps outside any loop over a DataLoader{more}: its batch is not split "
            "between ranks",
            "each rank computes this step on the tensors it holds: data drawn at random (torch.randn) differs "
            "between ranks and the step averages their gradients, so it does not train like the single run; read "
            "the batch from a DataLoader the rewrite gives a DistributedSampler, or draw the same data on every rank",
            differs=True,
        )

    def _unfollowed(self, tree: cst.Module, facts: ScriptFacts, training: list) -> None:
        """DataLoaders no loop can be traced to: refused where no training loader was
        found (one of them is likely it), reported otherwise."""
        for unfollowed in unfollowed_loaders(facts.analysis, facts.loaders):
            if not training and facts.loops:
                self.refuse(
                    "FSR902",
                    unfollowed.node,
                    f"a DataLoader {unfollowed.how}: the rewrite cannot follow it to the training loop",
                    "no training loop reads a DataLoader the rewrite can give a DistributedSampler; left as is, "
                    "every rank would train on the same batches",
                    "bind the training DataLoader to a name in the function that trains "
                    "(`loader = DataLoader(...)`, then `for batch in loader:`)",
                )
            self.attention(
                unfollowed.node,
                f"a DataLoader {unfollowed.how}: not followed, left as is (every rank reads all of it)",
                "right for evaluation; if it feeds training, every rank trains on the same batches: give it a "
                "DistributedSampler",
            )

    def _distribute(self, loader: LoaderSite, facts: ScriptFacts, editor: StatementEditor, several: bool) -> None:
        if loader.sampler is not None and loader.sampler.kind == "replacement":
            self._draw_per_rank(loader, facts, editor)
            return
        if loader.sampler is not None and isinstance(loader.sampler.expr, cst.Name):
            self._replace_bound_sampler(loader, facts, editor)
            return
        scope = facts.resolver.enclosing_function(loader.stmt)
        sampler = self.fresh_name(f"{loader.name}_sampler" if several else "sampler", scope)
        dataset, hoisted = self._dataset(loader, scope)
        shuffle = code(loader.shuffle) if loader.shuffle is not None else "False"
        if loader.sampler is not None:  # sampler=RandomSampler(data) written in the call
            shuffle = loader.sampler.shuffle
            dataset, hoisted = code(loader.sampler.dataset), None
        elif loader.shuffle_set_later is not None:
            # the dict's shuffle, whatever the statements before the loader made it, goes to the sampler
            shuffle = f'{loader.shuffle_set_later}.pop("shuffle", False)'
        extra = f", drop_last={code(loader.drop_last)}" if loader.drop_last is not None else ""
        early = self._before_group(loader.stmt, facts)
        new = []
        if hoisted is not None:
            new.append(self.stmt(f"{dataset} = {code(loader.dataset)}\n"))
        if early:  # built before the group starts (when the file loads): torchrun's environment says the same
            self.add_import("os")
            new.append(self.stmt(
                f"{sampler} = DistributedSampler(\n    {dataset},\n"
                '    num_replicas=int(os.environ.get("WORLD_SIZE", 1)),  # built before the process group starts\n'
                '    rank=int(os.environ.get("RANK", 0)),\n'
                f"    shuffle={shuffle}{extra},\n)\n"
            ))
        else:
            new.append(self.stmt(f"{sampler} = DistributedSampler({dataset}, shuffle={shuffle}{extra})\n"))
        batch, keep = (self._keep_global_batch(loader, facts, editor, new) if self.options.keep_global_batch
                       else (None, False))
        leading = list(loader.stmt.leading_lines)
        new[0] = new[0].with_changes(leading_lines=leading)
        editor.insert_before(loader.stmt, new)
        note = cst.EmptyLine(comment=cst.Comment(KEEP_NOTE if keep else BATCH_NOTE))
        editor.set_leading_lines(loader.stmt, [note])
        new_dataset = cst.Name(dataset) if hoisted is not None else None
        editor.replace_expression(loader.call, lambda call: _sampled(call, sampler, new_dataset, batch))
        if (loader.kwargs_dict is not None and loader.shuffle is not None and loader.shuffle_set_later is None
                and _has_key(loader.kwargs_dict, "shuffle")):
            editor.replace_expression(loader.kwargs_dict, lambda kwargs: without_entry(kwargs, "shuffle"))
        self.add_import("torch.utils.data.distributed", "DistributedSampler")
        self.change(
            loader.stmt,
            f"`{loader.name}` reads through a DistributedSampler (shuffle={shuffle}"
            + (f", drop_last={code(loader.drop_last)}" if loader.drop_last is not None else "")
            + ("); the batch size is divided by the world size, so the global batch stays as written"
               if keep else "); the per-rank batch size stays, so the global batch is world_size x larger"),
            "each rank must see its own part of the data",
            "without a sampler every rank trains on the same batches",
        )
        if early:
            self.change(
                loader.stmt,
                f"`{loader.name}`'s DistributedSampler takes the rank and the number of ranks from torchrun's "
                "environment (RANK, WORLD_SIZE; 0 and 1 for a plain run)",
                "it is built before the process group starts (at module level, the model in a function): "
                "asked of the group, it fails with 'Default process group has not been initialized'",
            )
        self._set_epoch(loader, sampler, facts, editor)
        if not keep:
            self._shaped_by_batch_size(loader, facts)

    def _shaped_by_batch_size(self, loader: LoaderSite, facts: ScriptFacts) -> None:
        """Tensors the training loop shapes by the loader's nominal batch size: a rank's last batch
        can now be partial where the single run's were full (check's FSD120, reported here)."""
        nominal = nominal_batch_size(loader.call)
        if nominal is None or nominal[1] or drops_last(loader.drop_last):
            return
        for call in batch_shaped_calls(facts.resolver, facts.resolver.nodes(cst.For), loader.name, nominal[0]):
            self.attention(
                call,
                f"FSD120: `{short_code(call)}` is shaped by `{nominal[0]}`, {PARTIAL_LAST_BATCH}",
                "DistributedSampler gives each rank ceil(len(dataset) / world_size) samples: where that does not "
                f"divide by `{nominal[0]}`, the rank's last batch is smaller and this tensor no longer matches it "
                "(a shape error, or samples mixed by a reshape) even where the single run's batches were all full; "
                "use the batch's own size (`x.size(0)`), or pass drop_last=True to the DataLoader",
            )

    def _replace_bound_sampler(self, loader: LoaderSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`sampler = RandomSampler(data)` bound before the loader: the call becomes
        `DistributedSampler(data, shuffle=True)` where it stands, the name stays."""
        site = loader.sampler
        extra = f", drop_last={code(loader.drop_last)}" if loader.drop_last is not None else ""
        new = f"DistributedSampler({code(site.dataset)}, shuffle={site.shuffle}{extra})"
        editor.replace_expression(site.call, lambda _call: self.expr(new))
        self.add_import("torch.utils.data.distributed", "DistributedSampler")
        self.change(
            site.call,
            f"`{code(site.call)}` -> `{new}`: `{loader.name}` reads its own part of the data on each rank",
            "a RandomSampler/SequentialSampler draws indices of the whole dataset on every rank",
            "left alone, every rank trains on the same batches",
        )
        self._set_epoch(loader, code(site.expr), facts, editor)

    def _draw_per_rank(self, loader: LoaderSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`RandomSampler(data, replacement=True, num_samples=N)`: no DistributedSampler draws
        with replacement, so the sampler stays, drawing on each rank its share of the N samples
        (`len(range(rank, N, world_size))`: the shares add up to N) from a generator of its own,
        seeded from the run's seed and the rank. Where it stands: inline or bound to a name."""
        site = loader.sampler
        stmt = facts.resolver.statement_of(site.call)
        if self._before_group(stmt, facts):
            self.refuse(
                "FSR901",
                site.call,
                f"`{loader.name}` draws with replacement through `{code(site.call)}`, built before the process "
                "group starts",
                "each rank must draw its own share from a generator seeded by its rank, which is not known there",
                "build the sampler (and its DataLoader) after init_process_group",
            )
        scope = facts.resolver.enclosing_function(stmt)
        samples, generator = self.fresh_name("rank_samples", scope), self.fresh_name("rank_generator", scope)
        total = code(site.num_samples) if site.num_samples is not None else f"len({code(site.dataset)})"
        new = [
            self.stmt(f"{samples} = len(range(dist.get_rank(), {total}, dist.get_world_size()))\n"),
            self.stmt(f"{generator} = torch.Generator().manual_seed(torch.initial_seed() + dist.get_rank())\n"),
        ]
        new[0] = new[0].with_changes(leading_lines=[*stmt.leading_lines, cst.EmptyLine(comment=cst.Comment(
            "# drawn with replacement: each rank draws its share of the samples, from a generator of its own"))])
        editor.set_leading_lines(stmt, [])
        sampler = (f"{code(site.call.func)}({code(site.dataset)}, replacement=True, num_samples={samples}, "
                   f"generator={generator})")
        editor.replace_expression(site.call, lambda _call: self.expr(sampler))
        self.add_import("torch")
        self.add_import("torch.distributed", asname="dist")
        if self.options.keep_global_batch:
            batch, _keep = self._keep_global_batch(loader, facts, editor, new)
            if batch is not None:
                editor.replace_expression(loader.call, lambda call: _replace_batch_size(call, batch))
        editor.insert_before(stmt, new)
        self.change(
            site.call,
            f"`{loader.name}` draws with replacement on each rank: its share of the {total} samples "
            f"(len(range(rank, {total}, world_size))), from a generator seeded with torch.initial_seed() + rank",
            "no DistributedSampler draws with replacement; each rank must draw samples of its own",
            "left alone, every rank (seeded alike) draws the same samples and trains on the same batches",
        )
        self.attention(
            site.call,
            f"`{loader.name}` draws with replacement: the samples each rank draws are not those of the "
            "single-process run",
            "a draw with replacement cannot be split between ranks the way a permutation can (DistributedSampler): "
            "each rank draws from its own random stream, so the batches, and the training, differ from the "
            f"single run's step by step; what stays equal is the number of samples per epoch ({total}, summed "
            "over the ranks) and their distribution (uniform over the whole dataset, with replacement)",
            differs=True,
        )

    def _keep_global_batch(self, loader: LoaderSite, facts: ScriptFacts, editor: StatementEditor, new: list) -> tuple:
        """--keep-global-batch: each rank reads batch_size // world_size, checked at run time.
        Returns (the loader's new batch_size= value or None where it stays, whether it is
        divided). A batch size the loader unpacks from a `**` dict is divided where the dict
        is given it (analysis.loader_kwargs)."""
        self._editor = editor
        size = _batch_size(loader.call)
        if size is not None:
            return self._divide(loader.name, facts, size, loader.stmt, new), True
        through = batch_size_through(facts.module, facts.resolver, loader.call)
        early = next((s.stmt for s in through.sets if self._before_group(s.stmt, facts)), None) if through else None
        if early is not None:  # no world size to divide by there yet
            through = KwargsBatchSize([], (early, "it is set before the process group starts"))
        if through is None or through.lost is not None or not through.sets:
            self._not_divided(loader, through)
            return None, False
        for found in through.sets:
            if id(found.value) in self.__dict__.setdefault("_divided", set()):
                continue  # a dict shared by two loaders: divided once
            self._divided.add(id(found.value))
            here = new if found.stmt is loader.stmt else []
            value = self._divide(loader.name, facts, found.value, found.stmt, here)
            if value is not None:
                editor.replace_expression(found.value, lambda _old, value=value: value)
            if here is not new:
                moved = self.__dict__.setdefault("_relead", set())
                if id(found.stmt) not in moved:  # the comments above the statement go above its assert
                    moved.add(id(found.stmt))
                    here[0] = here[0].with_changes(leading_lines=list(found.stmt.leading_lines))
                    editor.set_leading_lines(found.stmt, [])
                editor.insert_before(found.stmt, here)
            self.change(
                found.stmt,
                f"`{code(found.value)}`, the batch size `{loader.name}` unpacks from "
                f"`**{_unpacked(loader.call)}`, is divided by the world size here",
                "--keep-global-batch: each rank reads 1/world_size of the batch; the global batch stays as written",
                "the DataLoader's own call has no batch_size= to divide",
            )
        return None, True

    def _before_group(self, stmt: cst.CSTNode, facts: ScriptFacts) -> bool:
        """`stmt` runs before the process group starts: above it in the entry function, or at
        module level when the entry is a function (module code runs when the file is loaded)."""
        at_load = facts.resolver.enclosing_function(stmt) is None and isinstance(facts.entry_scope, cst.FunctionDef)
        return at_load or self.before_group(stmt, facts)

    def _not_divided(self, loader: LoaderSite, through) -> None:
        """The batch size could not be divided: the global batch grows world_size times."""
        if through is None:
            how = "is not an argument of the call (the DataLoader default, 1)"
        elif through.lost is not None:
            node, why = through.lost
            how = (f"comes through `**{_unpacked(loader.call)}`, which the rewrite cannot follow "
                   f"(line {self.line(node)}: {why})")
        else:
            how = f"is set nowhere in `**{_unpacked(loader.call)}` (the DataLoader default, 1)"
        self.attention(
            loader.stmt,
            f"--keep-global-batch: the batch size of `{loader.name}` {how}: not divided, so the global batch is "
            "world_size x larger than the single-process run's",
            "pass batch_size= to the DataLoader, or build its dict where the rewrite can follow it "
            "(`kw = {\"batch_size\": n, ...}` in the script), so the rewrite can divide it; or divide it yourself",
            differs=True,
        )

    def _divide(self, loader: str, facts: ScriptFacts, size: cst.BaseExpression, stmt: cst.CSTNode,
                new: list) -> Optional[cst.BaseExpression]:
        """The per-rank value of the batch size `size` of `loader` (its name, or the function that
        builds it), read in `stmt`, with its assert added to `new`, the statements that go before
        `stmt`; None where a name (or attribute) the script
        also reads to size batch tensors is rebound once to the per-rank size instead."""
        same_scope = facts.resolver.enclosing_function(stmt) is facts.resolver.enclosing_function(
            facts.models[0].stmt
        )
        world = "world_size" if same_scope else "dist.get_world_size()"
        text = code(size)
        operand = text if isinstance(size, (cst.Name, cst.Attribute, cst.Subscript, cst.Integer)) else f"({text})"
        readers = batch_size_readers(facts.resolver, stmt, size, [loop.node for loop in facts.loops])
        if readers is not None and readers.problem is not None:
            node, why = readers.problem
            self.refuse(
                "FSR903",
                node,
                f"--keep-global-batch: `{readers.key}`, the batch size of `{loader}`, also sizes batch tensors "
                f"(line {', '.join(str(self.line(n)) for n in readers.shape)}); {why}",
                "divided in the DataLoader only, the other reads would keep the global size and disagree with the "
                "per-rank batch (a shape error, or a silent broadcast)",
                f"bind the per-rank size to a name of its own (`{readers.key.split('.')[-1]}_per_rank = "
                f"{readers.key} // world_size`) read by the DataLoader and the batch tensors, or run without "
                "--keep-global-batch",
            )
        one = _one_sample(size, facts)
        if one is not None:
            self.refuse(
                "FSR905",
                size,
                f"--keep-global-batch: the batch size of `{loader}` is 1 (`{code(size)}`"
                + (f", line {self.line(one)}" if one is not size else "") + "): one sample a step cannot be split "
                "over the ranks",
                "the global batch stays as written with this option, and a batch of one sample has no part for a "
                "second rank (the generated assert would stop the run at its start)",
                "run without --keep-global-batch: each rank then reads one sample a step, the global batch "
                "world_size samples",
            )
        at = readers.rebind_at if readers is not None and readers.shape and readers.problem is None else None
        if at is not None:  # a batch tensor sized above the loader: the name is per-rank from there on
            new = []
            if self._before_group(at, facts):
                self.add_import("os")
                world = 'int(os.environ.get("WORLD_SIZE", 1))'
        new.append(self.stmt(f'assert {operand} % {world} == 0, "the batch size must divide by the number of ranks"\n'))
        if readers is None or not readers.shape:
            return self.expr(f"{operand} // {world}")
        new.append(self.stmt(f"{text} = {text} // {world}  # per rank from here on\n"))
        if at is not None:
            new[0] = new[0].with_changes(leading_lines=list(at.leading_lines))
            self._editor.set_leading_lines(at, [])
            self._editor.insert_before(at, new)
        self.change(
            at if at is not None else stmt,
            f"`{text}` is rebound to the per-rank size before "
            + (f"its first batch tensor (line {self.line(at)}), above `{loader}`" if at is not None else f"`{loader}`")
            + f": its reads at line {', '.join(str(self.line(n)) for n in readers.shape)} size tensors of one batch",
            "those tensors must match the per-rank batch the loader now yields",
            "dividing only the loader's argument leaves them at the global size: a shape error or a silent "
            "broadcast against the smaller batch",
        )
        return None

    def _dataset(self, loader: LoaderSite, scope):
        if isinstance(loader.dataset, (cst.Name, cst.Attribute)):
            return code(loader.dataset), None
        name = self.fresh_name("dataset", scope)
        return name, loader.dataset

    def _set_epoch(self, loader: LoaderSite, sampler: str, facts: ScriptFacts, editor) -> None:
        epoch_loop = _epoch_loop(loader, facts)
        if epoch_loop is None and loader.received is not None:  # `train_loader, val_loader = build_loaders(...)`
            name, block = loader.received
            epoch_loop = _epoch_loop_over(name, block, facts)
            sampler = f"{name}.sampler" if epoch_loop is not None else sampler
        for fn, param in loader.handed_to if epoch_loop is None else ():
            # `train_model(model, loader, epochs)` whose own epoch loop passes over its parameter
            epoch_loop = _epoch_loop_over(param, fn.body, facts)
            if epoch_loop is not None:
                sampler = f"{param}.sampler"
                break
        if epoch_loop is None and loader.epoch_passed is not None and loader.epoch_passed[2] is not None:
            self._set_epoch_passed(loader, editor)
            return
        if epoch_loop is None and self._count_passes(loader, sampler, facts, editor):
            return
        if epoch_loop is None:
            shuffled = loader.shuffle is not None and code(loader.shuffle) != "False"
            if shuffled and loader.epoch_passed is not None:
                self._no_epoch_passed(loader)
            elif shuffled and not _iterated_directly(loader):
                self.attention(
                    loader.stmt,
                    f"`{loader.name}` is read through iter()/next() or a helper: call "
                    f"`{sampler}.set_epoch(epoch)` each time a new pass over it starts",
                    "DistributedSampler reshuffles from its epoch number; without it every pass after the first "
                    "repeats the first one's order, where the original loader drew a new one",
                    differs=True,
                )
            return
        if facts.resolver.enclosing_function(epoch_loop) is not facts.resolver.enclosing_function(loader.stmt) and (
                "." not in sampler):
            # the epoch loop is another function's, reading the loader by the same name: through the loader
            # itself, not a name of the loader's scope (in a project that function may be another module's)
            sampler = f"{loader.name}.sampler"
        first = epoch_loop.body.body[0]
        call = f"{sampler}.set_epoch({epoch_loop.target.value})"
        if code(first) == call:
            return
        editor.insert_before(first, [self.stmt(call + "\n")])
        self.change(
            epoch_loop,
            f"`{call}` at the start of each epoch",
            "DistributedSampler reshuffles from its epoch number",
            "without set_epoch every epoch repeats the same order",
        )

    def _set_epoch_passed(self, loader: LoaderSite, editor) -> None:
        """The pass over the loader is made where the loader is not a name of its block (a trainer's
        `for x, y in self.train_data:`), its epoch number the variable of the `for ... in range(...)`
        around it or handed to its method (`self._run_epoch(epoch)`): set_epoch before that pass,
        through the loader's own `.sampler` (the DistributedSampler given it where it is built)."""
        loop, reader, epoch = loader.epoch_passed
        call = f"{code(reader)}.sampler.set_epoch({epoch})"
        editor.insert_before(loop, [self.stmt(call + "\n")])
        self.change(
            loop,
            f"`{call}` before each pass over `{code(reader)}`, `{epoch}` holding the number of the epoch",
            "DistributedSampler reshuffles from its epoch number",
            "without set_epoch every epoch repeats the same order",
        )

    def _no_epoch_passed(self, loader: LoaderSite) -> None:
        """A pass like _set_epoch_passed's whose epoch number the analysis cannot follow: flagged at the pass."""
        loop, reader, _ = loader.epoch_passed
        self.attention(
            loop,
            f"this pass over `{code(reader)}` (the DataLoader of line {self.line(loader.stmt)}) has no epoch number "
            f"the rewrite can follow: call `{code(reader)}.sampler.set_epoch(epoch)` before it",
            "DistributedSampler reshuffles from its epoch number, known here only as the variable of a "
            "`for ... in range(...)` around the pass or handed to its function by one; without it every pass "
            "repeats the first one's order, where the original loader drew a new one",
            differs=True,
        )

    def _count_passes(self, loader: LoaderSite, sampler: str, facts: ScriptFacts, editor) -> bool:
        """A pass (`for ... in loader:`) repeated by a `while` (`while step < max_steps:`) has no epoch
        variable: count the passes in a new one and hand it to set_epoch before each. The same
        in a function the loader is handed to (`def cycle(dl): while True: for b in dl: yield b`)."""
        shuffled = loader.shuffle is not None and code(loader.shuffle) != "False"
        if not shuffled:  # unshuffled: every epoch reads one order
            return False
        name = loader.name
        site = pass_in_while(facts.resolver, name, loader.block)
        if site is None and loader.cycled is not None:  # in the generator, over its parameter
            *site, name = loader.cycled
            sampler = f"{name}.sampler"
        if site is None:
            return False
        while_loop, one_pass = site
        counter = self.fresh_name("epoch", facts.resolver.enclosing_function(while_loop))
        call = f"{sampler}.set_epoch({counter})"
        editor.insert_before(while_loop, [self.stmt(f"{counter} = 0  # passes over {name}\n")])
        editor.insert_before(one_pass, [self.stmt(call + "\n"), self.stmt(f"{counter} += 1\n")])
        self.change(
            one_pass,
            f"`{call}` before each pass over `{name}`, counting the passes in `{counter}`",
            "DistributedSampler reshuffles from its epoch number; the `while` loop repeating the pass has none",
            "without set_epoch every pass repeats the first one's order",
        )
        return True


def _epoch_loop(loader: LoaderSite, facts: ScriptFacts) -> Optional[cst.For]:
    """The innermost `for <name> in ...` around a whole pass over the loader: a loop
    over it, or a call that hands it to a function (`train_one_epoch(model, loader)`)."""
    return _epoch_loop_over(loader.name, loader.block, facts)


def _epoch_loop_over(name: str, block, facts: ScriptFacts) -> Optional[cst.For]:
    """`_epoch_loop` for the loader bound to `name` in `block`."""
    best = None
    # functions that loop over the loader as a global (`def train(epoch): for x in trainloader`)
    # or, nested in the loader's function, through their closure
    scope = facts.resolver.enclosing_function(block)
    readers = {
        fn.name.value for fn in functions_reading(facts.resolver, scope, name)
        if _passes_over(fn.body, name, loops_only=True)
    }
    for node in facts.resolver.descendants(block, cst.For):  # outer loops first
        if not isinstance(node.target, cst.Name) or name in names_in(node.iter):
            continue
        if isinstance(node.body, cst.SimpleStatementSuite):
            continue
        if _passes_over(node.body, name, readers=readers):
            best = node  # the last kept is the innermost
    return best


def _passes_over(body, name: str, readers=frozenset(), loops_only: bool = False) -> bool:
    """`body` goes over the loader `name`: a loop over it, a call handing it to a
    function, or a call of one of `readers` (functions looping over it as a global)."""
    for node in walk(body):
        kind = type(node)
        if kind is cst.For and iterated_name(node.iter) == name:
            return True
        if kind is not cst.Call or loops_only:
            continue
        if any(isinstance(a.value, cst.Name) and a.value.value == name for a in node.args) and not (
            isinstance(node.func, cst.Name) and node.func.value in ("iter", "next", "len", "enumerate")
        ):
            return True
        if isinstance(node.func, cst.Name) and node.func.value in readers:
            return True
    return False


def _iterated_directly(loader: LoaderSite) -> bool:
    """Some `for` loop goes over the loader itself (one pass per loop)."""
    return any(type(n) is cst.For and iterated_name(n.iter) == loader.name for n in walk(loader.block))


def _has_key(node, key: str) -> bool:
    if isinstance(node, cst.Call):
        return any(a.keyword is not None and a.keyword.value == key for a in node.args)
    return any(
        isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString) and e.key.evaluated_value == key
        for e in node.elements
    )


def _batch_size(call: cst.Call) -> Optional[cst.BaseExpression]:
    for i, a in enumerate(call.args):
        if (a.keyword is not None and a.keyword.value == "batch_size") or (a.keyword is None and not a.star and i == 1):
            return a.value
    return None


def _unpacked(call: cst.Call) -> str:
    """The first `**` argument of a call, as written."""
    return next(code(a.value) for a in call.args if a.star == "**")


def _replace_batch_size(call: cst.Call, value: cst.BaseExpression) -> cst.Call:
    args = list(call.args)
    for i, a in enumerate(args):
        if (a.keyword is not None and a.keyword.value == "batch_size") or (a.keyword is None and not a.star and i == 1):
            args[i] = a.with_changes(value=value)
            break
    return call.with_changes(args=args)


def _one_sample(size: cst.BaseExpression, facts: ScriptFacts) -> Optional[cst.CSTNode]:
    """The literal 1 a batch size holds (`batch_size=1`, `BATCH_SIZE = 1` followed by value),
    or None where it may hold anything else."""
    flow = facts.analysis.flow if facts.analysis is not None else None
    values = flow.values(size) if flow is not None else frozenset({size})
    ones = [v for v in values if isinstance(v, cst.Integer) and v.evaluated_value == 1]
    return ones[0] if ones and len(ones) == len(values) else None
