"""data: give every training DataLoader a DistributedSampler, and set its epoch."""
from __future__ import annotations

from typing import Dict, Optional

import libcst as cst

from fsdp2_retrofit.analysis import LoaderSite, ScriptFacts, code
from fsdp2_retrofit.syntax.names import iterated_name, names_in
from fsdp2_retrofit.rewrite.edit import with_keyword, without_entry, without_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

BATCH_NOTE = "# The per-rank batch stays as written: the global batch is now world_size x larger."
KEEP_NOTE = "# --keep-global-batch: each rank reads 1/world_size of the batch; the global batch stays as written."


class _DataEditor(StatementEditor):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Dict[cst.CSTNode, tuple] = {}  # loader call -> (sampler name, dataset replacement)
        self.dicts: set = set()  # kwargs dicts that lose their "shuffle"
        self.batch: Dict[cst.CSTNode, cst.BaseExpression] = {}  # loader call -> per-rank batch size

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call):
        if original_node in self.calls:
            sampler, dataset = self.calls[original_node]
            updated_node = without_keyword(updated_node, "shuffle")
            if dataset is not None:
                updated_node = _replace_dataset(updated_node, dataset)
            if original_node in self.batch:
                updated_node = _replace_batch_size(updated_node, self.batch[original_node])
            return with_keyword(updated_node, "sampler", cst.Name(sampler))
        if original_node in self.dicts:
            return without_entry(updated_node, "shuffle")
        return updated_node

    def leave_Dict(self, original_node: cst.Dict, updated_node: cst.Dict):
        if original_node in self.dicts:
            return without_entry(updated_node, "shuffle")
        return updated_node


class DistributeDataCommand(RetrofitStage):
    DESCRIPTION = "Shard the training data across ranks with DistributedSampler and set_epoch."
    CODE = "data"

    def make_editor(self) -> StatementEditor:
        return _DataEditor()

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: _DataEditor) -> None:
        training = [l for l in facts.loaders if l.trains]
        if not training and facts.loops and not facts.loaders:
            self.attention(
                facts.loops[0].node,
                "no DataLoader: the batches do not come from a sampler this tool can shard",
                "after the retrofit every rank trains on the same data; split the batches by "
                "dist.get_rank() / dist.get_world_size() or use a DataLoader with DistributedSampler",
            )
        for loader in facts.loaders:
            if not loader.trains:
                self.attention(
                    loader.stmt,
                    f"`{loader.name}` is not used by a training loop: left as is (every rank reads all of it)",
                    "evaluation on every rank is correct but repeats the work; shard it and all-reduce the metric to save time",
                )
        for loader in training:
            if loader.has_sampler:
                continue
            self._distribute(loader, facts, editor, several=len(training) > 1)

    def _distribute(self, loader: LoaderSite, facts: ScriptFacts, editor: _DataEditor, several: bool) -> None:
        scope = facts.resolver.enclosing_function(loader.stmt)
        sampler = self.fresh_name(f"{loader.name}_sampler" if several else "sampler", scope)
        dataset, hoisted = self._dataset(loader, scope)
        shuffle = code(loader.shuffle) if loader.shuffle is not None else "False"
        extra = f", drop_last={code(loader.drop_last)}" if loader.drop_last is not None else ""
        new = []
        if hoisted is not None:
            new.append(self.stmt(f"{dataset} = {code(loader.dataset)}\n"))
        new.append(self.stmt(f"{sampler} = DistributedSampler({dataset}, shuffle={shuffle}{extra})\n"))
        keep = self.options.keep_global_batch and self._keep_global_batch(loader, facts, editor, new)
        leading = list(loader.stmt.leading_lines)
        new[0] = new[0].with_changes(leading_lines=leading)
        editor.insert_before(loader.stmt, new)
        note = cst.EmptyLine(comment=cst.Comment(KEEP_NOTE if keep else BATCH_NOTE))
        editor.set_leading_lines(loader.stmt, [note])
        editor.calls[loader.call] = (sampler, cst.Name(dataset) if hoisted is not None else None)
        if loader.kwargs_dict is not None and loader.shuffle is not None and _has_key(loader.kwargs_dict, "shuffle"):
            editor.dicts.add(loader.kwargs_dict)
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
        self._set_epoch(loader, sampler, facts, editor)

    def _keep_global_batch(self, loader: LoaderSite, facts: ScriptFacts, editor: _DataEditor, new: list) -> bool:
        """--keep-global-batch: each rank reads batch_size // world_size, checked at run time."""
        size = _batch_size(loader.call)
        if size is None:
            self.attention(
                loader.stmt,
                f"--keep-global-batch: the batch size of `{loader.name}` is not an argument of the call: not divided",
                "pass batch_size= to the DataLoader (not through a dict) so the rewrite can divide it",
            )
            return False
        same_scope = facts.resolver.enclosing_function(loader.stmt) is facts.resolver.enclosing_function(
            facts.models[0].stmt
        )
        world = "world_size" if same_scope else "dist.get_world_size()"
        text = code(size)
        operand = text if isinstance(size, (cst.Name, cst.Attribute, cst.Integer)) else f"({text})"
        new.append(self.stmt(f'assert {operand} % {world} == 0, "the batch size must divide by the number of ranks"\n'))
        editor.batch[loader.call] = self.expr(f"{operand} // {world}")
        return True

    def _dataset(self, loader: LoaderSite, scope):
        if isinstance(loader.dataset, (cst.Name, cst.Attribute)):
            return code(loader.dataset), None
        name = self.fresh_name("dataset", scope)
        return name, loader.dataset

    def _set_epoch(self, loader: LoaderSite, sampler: str, facts: ScriptFacts, editor) -> None:
        epoch_loop = _epoch_loop(loader, facts)
        if epoch_loop is None:
            shuffled = loader.shuffle is not None and code(loader.shuffle) != "False"
            if shuffled and not _iterated_directly(loader):
                self.attention(
                    loader.stmt,
                    f"`{loader.name}` is read through iter()/next() or a helper: call "
                    f"`{sampler}.set_epoch(epoch)` each time a new pass over it starts",
                    "DistributedSampler reshuffles from its epoch number; without it every pass repeats one order",
                )
            return
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


def _epoch_loop(loader: LoaderSite, facts: ScriptFacts) -> Optional[cst.For]:
    """The innermost `for <name> in ...` around a whole pass over the loader: a loop
    over it, or a call that hands it to a function (`train_one_epoch(model, loader)`)."""
    best = None
    for node in facts.resolver.descendants(loader.block, cst.For):  # outer loops first
        if not isinstance(node.target, cst.Name) or loader.name in names_in(node.iter):
            continue
        if isinstance(node.body, cst.SimpleStatementSuite):
            continue
        if _passes_over(node.body, loader.name):
            best = node  # the last kept is the innermost
    return best


def _passes_over(body, name: str) -> bool:
    found = []

    class _P(cst.CSTVisitor):
        def visit_For(self, node: cst.For) -> None:
            if iterated_name(node.iter) == name:
                found.append(node)

        def visit_Call(self, node: cst.Call) -> None:
            if any(isinstance(a.value, cst.Name) and a.value.value == name for a in node.args) and not (
                isinstance(node.func, cst.Name) and node.func.value in ("iter", "next", "len", "enumerate")
            ):
                found.append(node)

    body.visit(_P())
    return bool(found)


def _iterated_directly(loader: LoaderSite) -> bool:
    """Some `for` loop goes over the loader itself (one pass per loop)."""
    found = []

    class _F(cst.CSTVisitor):
        def visit_For(self, node: cst.For) -> None:
            if iterated_name(node.iter) == loader.name:
                found.append(node)

    loader.block.visit(_F())
    return bool(found)


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


def _replace_batch_size(call: cst.Call, value: cst.BaseExpression) -> cst.Call:
    args = list(call.args)
    for i, a in enumerate(args):
        if (a.keyword is not None and a.keyword.value == "batch_size") or (a.keyword is None and not a.star and i == 1):
            args[i] = a.with_changes(value=value)
            break
    return call.with_changes(args=args)


def _replace_dataset(call: cst.Call, dataset: cst.Name) -> cst.Call:
    args = list(call.args)
    for i, a in enumerate(args):
        if (a.keyword is not None and a.keyword.value == "dataset") or (a.keyword is None and not a.star):
            args[i] = a.with_changes(value=dataset)
            break
    return call.with_changes(args=args)
