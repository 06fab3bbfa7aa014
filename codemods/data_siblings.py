"""The data stage's edits of a sibling module: a training DataLoader a function of another
project file builds (`loader = create_dataloader(...)`, `from data_utils import create_dataloader`)
gets its DistributedSampler there (in the program linked into one analysis: rewrite/link.py, where
the function is the script's own), and its epoch is set where the loader is read.

When every call of the function feeds training, the DataLoader simply reads through the
sampler. When only some do (`train_loader = make(..., shuffle=True)` beside `val_loader =
make(..., shuffle=False)`), the function gets a parameter `distributed=False`, the DataLoader
takes the sampler only when it is true, and the training calls pass `distributed=True`: the
other loaders stay as they were, as a validation loader of the script does. A function of the
script itself that builds the training loader and a validation loader gets the same edits, made in
the script (_ScriptUnit)."""
from __future__ import annotations

import os
from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.analysis import LoaderSite, ScriptFacts, code
from fsdp2_retrofit.report import Refusal, RefusedError
from fsdp2_retrofit.analysis.data import loader_dataset
from fsdp2_retrofit.analysis.sibling_loaders import SiblingLoader
from fsdp2_retrofit.rewrite.edit import with_keyword, without_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import keyword_arg

FLAG = "distributed"  # the parameter a helper shared by training and other loaders gets


class SiblingLoaderEdits:
    """Mixin of the data stage (a RetrofitStage)."""

    def _distribute_elsewhere(self, elsewhere: list, facts: ScriptFacts, editor: StatementEditor) -> list:
        """Give the DataLoader each sibling function builds its DistributedSampler there, for the
        calls of the script that feed a training loop, when nothing stands in the way
        (SiblingLoader.blocker); set the epoch in the script. Returns (call, why) for the calls
        left as they are (each an attention item, the reason in its message)."""
        left = []
        by_function: dict = {}
        for found in elsewhere:
            by_function.setdefault((found.path, found.function), []).append(found)
        for calls in by_function.values():
            found = calls[0]
            left.extend(self._distribute_helper(calls, facts, editor, lambda found=found: self._not_here(found),
                                                found.blocker(self.context.filename or "")))
        return left

    def _distribute_helper(self, calls: list, facts: ScriptFacts, editor: StatementEditor, unit_for,
                           blocker: str, trains=None, dataset: Optional[str] = None) -> list:
        """The DataLoader one function builds (in a sibling module, or in the script: `unit_for()`
        gives the unit its edits go to, None where it cannot be edited) reads through a
        DistributedSampler for the calls (`calls`, SiblingLoader records) whose loader trains: all of
        them, or those that pass the new `distributed=True` where only some do. Returns (call, why)
        for the calls left as they are. `trains(call)`: whether a call's loader feeds training (by
        default, whether a training loop reads the value of the call)."""
        found = calls[0]
        trains = trains or (lambda call: facts.analysis.loop_fed_by(call) is not None)
        training = [c for c in calls if trains(c.call)]
        why = "" if training else f"no call of {found.function}() feeds a training loop"
        why = why or blocker
        flag = None
        if not why and len(training) < len(calls):
            flag, why = self._flag_for(found)
        unit = None if why else unit_for()
        if unit is None:
            return [(c, why or "its module is not in the program this rewrite linked") for c in calls]
        self._sample_there(found, unit, flag, dataset)
        for c in training:
            if self.options.keep_global_batch:
                self._keep_batch_at_call(found, c, facts, editor)
            if flag is not None:
                editor.replace_expression(c.call, lambda call: with_keyword(call, flag, cst.Name("True")))
                self.change(c.call, f"`{flag}=True`: the loader {found.function}() returns here trains, so it "
                            "reads through a DistributedSampler",
                            f"the other calls of {found.function}() build loaders that do not train (left as "
                            "they were: every rank reads all of them)",
                            "without a sampler every rank trains on the same batches")
        shuffle = keyword_arg(found.built, "shuffle")
        if shuffle is not None and code(shuffle) != "False":
            for c in training:
                self._set_epoch_received(c, facts, editor)
        return []

    def _not_here(self, found) -> None:
        """A sibling module's DataLoader is edited where it is when the program is linked into one
        analysis (rewrite/link.py); this run has the script alone: refused where that module lies
        outside the project (no run could edit it), else left to the caller's report (None)."""
        from fsdp2_retrofit.rewrite.workspace import Workspace

        why = Workspace(self.context.filename or found.path).not_editable(os.path.realpath(found.path))
        if why:
            raise RefusedError(Refusal(
                found.line, f"{self.CODE}: the training DataLoader {found.function}() builds is in {found.file}, {why}",
                "the DataLoader needs a DistributedSampler where it is built, and the rewrite edits only the script "
                "and the project's own modules",
                "copy the code into the project (or the script), or make the change there by hand",
                "FSR904", path=found.path))
        return None

    def _distribute_shared_helper(self, loader, facts: ScriptFacts, editor: StatementEditor) -> bool:
        """The training DataLoader `loader` is built by a function of this file that also builds loaders
        that do not train (`val_loader = make_loader(..., shuffle=False)`): its edits are those of a sibling
        module's helper, made here. False where every call of it trains (or it is no such helper's)."""
        shared = self._shared_helper(loader, facts)
        if shared is None:
            return False
        script = self.context.filename or ""
        inline = loader_dataset(loader.call)  # `DataLoader(TensorDataset(x, y), ...)`: bound to a name first
        named = None if inline is None or isinstance(inline, cst.Name) else self.fresh_name("dataset", shared[0].function_def)
        blocker = shared[0].blocker(script, False, dataset_named=named is not None)
        if named is not None and not blocker:
            editor.insert_before(loader.stmt, [self.stmt(f"{named} = {code(inline)}\n")])
        for found, why in self._distribute_helper(shared, facts, editor, lambda: _ScriptUnit(self, editor),
                                                  blocker, facts.analysis.helper_call_trains, named):
            self.attention(
                found.call,
                f"the DataLoader {found.function}() builds (line {found.line}) is left as it is ({why}): it "
                "gets no DistributedSampler, so every rank reads all of it (where it trains, every rank "
                "trains on the same batches)",
                f"give {found.function}() a parameter that says whether its loader trains, and that loader "
                "`sampler=DistributedSampler(dataset, shuffle=...)` in place of `shuffle=`",
                differs=True,
            )
        return True

    def _shared_helper(self, loader: LoaderSite, facts: ScriptFacts) -> Optional[list]:
        """The calls (SiblingLoader records) of the function of this file that builds and returns the
        training DataLoader `loader`, where only some of them feed a training loop (DataAnalysis.
        shared_helper_calls): None where every call trains, or the loader is not such a helper's."""
        r = facts.resolver
        calls = facts.analysis.shared_helper_calls(loader)
        fn = r.enclosing_function(loader.stmt)
        if calls is None and fn is not None and loader.returned and fn is not facts.entry_scope:
            self._unseen_helper_use(loader, fn, facts)
        if calls is None or fn is facts.entry_scope:
            return None
        shown = os.path.basename(self.context.filename or "the script")
        return [SiblingLoader(c, fn.name.value, shown, r.line(loader.call), loader.call, r,
                              self.context.filename or "", fn) for c in calls]

    def _unseen_helper_use(self, loader: LoaderSite, fn: cst.FunctionDef, facts: ScriptFacts) -> None:
        """The function or method that builds and returns the training DataLoader is also used where the
        analysis cannot follow (`getattr(self, name)`, handed on as a value): which of its loaders train
        cannot be told, so its DataLoader is split for every use; said at that use, since a validation
        loader it builds there is then read in parts."""
        use = facts.analysis.unseen_use(fn)
        if use is None:
            return
        self.attention(
            use,
            f"`{fn.name.value}` is used here in a way the rewrite does not follow: the DataLoader it builds (line "
            f"{facts.resolver.line(loader.call)}) reads through a DistributedSampler for every call, so a loader "
            "it builds for evaluation is read in parts (each rank scores its own share)",
            f"call {fn.name.value}() by its name (`self.{fn.name.value}(...)`) so the rewrite can split the training "
            "loader only, or give it a parameter that says whether its loader trains",
            differs=True,
        )

    def _flag_for(self, found) -> tuple:
        """(the name of the new parameter, "") for a function whose DataLoader trains for some calls
        only, or (None, why it cannot get one)."""
        params = found.function_def.params
        if params.star_kwarg is not None:
            return None, f"{found.function}() takes **{params.star_kwarg.name.value}: no parameter can be added"
        taken = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
        if FLAG in taken or FLAG in {n.value for n in found.resolver.descendants(found.function_def, cst.Name)}:
            return None, f"{found.function}() already uses the name `{FLAG}`"
        return FLAG, ""

    def _sample_there(self, found, unit, flag: Optional[str], named: Optional[str] = None) -> None:
        """The DataLoader call of the sibling reads through a DistributedSampler (when `flag` is
        true, if given); the function takes `flag=False`. `named`: the name its dataset was bound to."""
        built = found.built
        dataset = named or code(loader_dataset(built))
        shuffle, drop_last = keyword_arg(built, "shuffle"), keyword_arg(built, "drop_last")
        shuffle_text = code(shuffle) if shuffle is not None else "False"
        extra = f", drop_last={code(drop_last)}" if drop_last is not None else ""
        sampler_text = f"DistributedSampler({dataset}, shuffle={shuffle_text}{extra})"
        if flag is None:
            sampler = self.expr(sampler_text)

            def edit(call: cst.Call) -> cst.Call:
                return with_keyword(without_keyword(call, "shuffle"), "sampler", sampler)
        else:
            sampler = self.expr(f"{sampler_text} if {flag} else None")
            kept = self.expr(f"None if {flag} else {shuffle_text}") if shuffle is not None else None

            def edit(call: cst.Call) -> cst.Call:
                args = [a.with_changes(value=kept) if a.keyword is not None and a.keyword.value == "shuffle" else a
                        for a in call.args]
                return with_keyword(call.with_changes(args=args), "sampler", sampler)

            params = found.function_def.params
            new_param = cst.Param(cst.Name(flag), default=cst.Name("False"),
                                  equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")))
            unit.editor.replace_expression(params, lambda p: _with_param(p, new_param))
            unit.change(self.CODE, found.function_def,
                        f"{found.function}() takes `{flag}=False`: its DataLoader reads through a DistributedSampler "
                        f"when it is true (the calls of {self.context.filename} whose loader trains pass True)",
                        "each rank must see its own part of the training data; the other loaders stay as they were",
                        "without a sampler every rank trains on the same batches")
        unit.editor.replace_expression(
            built, edit if named is None else lambda call: edit(replace_dataset(call, cst.Name(named))))
        unit.add_import("torch.utils.data.distributed", "DistributedSampler")
        unit.change(
            self.CODE, built,
            f"the DataLoader {found.function}() builds reads through `{sampler_text}`"
            + (f" when `{flag}` is true" if flag else f" (every call of {found.function}() in "
               f"{self.context.filename} feeds training)")
            + "; the per-rank batch size stays, so the global batch is world_size x larger",
            "each rank must see its own part of the data",
            "without a sampler every rank trains on the same batches",
        )

    def _keep_batch_at_call(self, found, call, facts: ScriptFacts, editor: StatementEditor) -> None:
        """--keep-global-batch for a training loader a sibling function builds: the value the
        script's call passes for the parameter that is the DataLoader's batch size there is
        divided by the world size at the call (checked at run time, as a DataLoader's own
        batch_size= is); where it cannot be, the call gets an attention item (verify refuses)."""
        param, how = _batch_size_parameter(found)
        value = None
        if param is not None:
            value, how = _argument_for(found.function_def.params, param, call.call)
        stmt = facts.resolver.statement_of(call.call)
        if value is not None and self._before_group(stmt, facts):
            value, how = None, "the call comes before the process group starts (no world size to divide by there)"
        if value is None:
            self.attention(
                call.call,
                f"--keep-global-batch: the batch size of the DataLoader {found.function}() builds ({found.file}, "
                f"its line {found.line}) {how}: not divided, so the global batch is world_size x larger than the "
                "single-process run's",
                f"pass the batch size to {found.function}() as the argument of a parameter its DataLoader reads "
                "as batch_size= and nothing else, so the rewrite can divide it at the call; or divide it yourself",
                differs=True,
            )
            return
        new: list = []
        divided = self._divide(found.function + "()", facts, value, stmt, new)
        if divided is not None:
            editor.replace_expression(value, lambda _old, divided=divided: divided)
        moved = self.__dict__.setdefault("_relead", set())
        if id(stmt) not in moved:  # the comments above the statement go above its assert
            moved.add(id(stmt))
            new[0] = new[0].with_changes(leading_lines=list(stmt.leading_lines))
            editor.set_leading_lines(stmt, [])
        editor.insert_before(stmt, new)
        self.change(
            stmt,
            f"`{code(value)}`, passed to {found.function}() for `{param}`, the batch size of the DataLoader it "
            f"builds ({found.file}), is divided by the world size here",
            "--keep-global-batch: each rank reads 1/world_size of the batch; the global batch stays as written",
            f"the DataLoader is built in {found.file}, from the value this call passes",
        )

    def _set_epoch_received(self, found, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`<loader>.sampler.set_epoch(epoch)` for the loader a call of the script receives
        (`loader = make(...)`), at the start of the epoch loop that passes over it there or in a
        function it is handed to; an attention item where the loader is not bound to a name."""
        from .data import _epoch_loop_over

        stmt = facts.resolver.statement_of(found.call)
        small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
        name = None
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and small.value is found.call:
            target = small.targets[0].target
            name = target.value if isinstance(target, cst.Name) else None
        block = facts.resolver.enclosing_function(stmt) or facts.module
        epoch_loop = _epoch_loop_over(name, block, facts) if name is not None else None
        handed = facts.analysis.handed_to(found.call)
        if not handed and name is not None:  # a helper of this file: the name it binds, handed on
            handed = facts.analysis.name_handed_to(name, facts.resolver.enclosing_function(stmt))
        for fn, param in handed if epoch_loop is None else ():
            # `train(model, loader)` whose own epoch loop passes over its parameter
            epoch_loop = _epoch_loop_over(param, fn.body, facts)
            if epoch_loop is not None:
                name = param
                break
        if epoch_loop is None and self._set_epoch_held(found, facts, editor):
            return
        if epoch_loop is None and name is not None:
            return  # no loop repeats passes over it: one pass, one order
        if epoch_loop is None:
            self.attention(
                found.call,
                f"the loader {found.function}() returns: call `loader.sampler.set_epoch(epoch)` each time a new "
                "pass over it starts",
                "DistributedSampler reshuffles from its epoch number; without it every pass after the first "
                "repeats the first one's order, where the original loader drew a new one",
                differs=True,
            )
            return
        call = f"{name}.sampler.set_epoch({epoch_loop.target.value})"
        first = epoch_loop.body.body[0]
        if code(first) == call:
            return
        editor.insert_before(first, [self.stmt(call + "\n")])
        self.change(
            epoch_loop,
            f"`{call}` at the start of each epoch",
            "DistributedSampler reshuffles from its epoch number",
            "without set_epoch every epoch repeats the same order",
        )

    def _set_epoch_held(self, found, facts: ScriptFacts, editor: StatementEditor) -> bool:
        """The repeated pass over the training loader that the analysis found (LoaderSite.epoch_passed: a
        trainer's `for x, y in self.train_loader:` in another method, or the call handing it to the function
        that passes over it) reads the value of this call of the helper and of no other
        (DataAnalysis.helper_calls_held): the epoch is set before that pass, as for a DataLoader built there
        (the data stage's _set_epoch_passed). False where there is no such pass."""
        loader = next((l for l in facts.loaders if l.call is found.built), None)
        passed = loader.epoch_passed if loader is not None else None
        siblings = [c for fn, _ in facts.analysis.callees(found.call) for c in facts.analysis.helper_calls(fn)]
        if passed is None or facts.analysis.helper_calls_held(passed[1], siblings or [found.call]) != {found.call}:
            return False
        if passed[2] is None:
            self._no_epoch_passed(loader)
        else:
            self._set_epoch_passed(loader, editor)
        return True


class _ScriptUnit:
    """The script as the unit of a helper's edits (the sibling-module edits, applied here)."""

    def __init__(self, stage: RetrofitStage, editor: StatementEditor) -> None:
        self.stage, self.editor = stage, editor

    def change(self, _code: str, node, what: str, why: str, pitfall: str = "") -> None:
        self.stage.change(node, what, why, pitfall)

    def add_import(self, module: str, obj: Optional[str] = None, asname: Optional[str] = None) -> None:
        self.stage.add_import(module, obj, asname)


def replace_dataset(call: cst.Call, dataset: cst.Name) -> cst.Call:
    """The DataLoader call reading `dataset` (its first positional argument or `dataset=`)."""
    args = list(call.args)
    for i, a in enumerate(args):
        if (a.keyword is not None and a.keyword.value == "dataset") or (a.keyword is None and not a.star):
            args[i] = a.with_changes(value=dataset)
            break
    return call.with_changes(args=args)


def _batch_size_parameter(found) -> tuple:
    """(the parameter of the sibling function that is its DataLoader's batch size, "") when the
    DataLoader reads it as `batch_size=` and the function reads or binds it nowhere else; else
    (None, how the batch size is set instead)."""
    built, fn = found.built, found.function_def
    size = keyword_arg(built, "batch_size")
    positional = [a.value for a in built.args if a.keyword is None and not a.star]
    if size is None and len(positional) > 1:
        size = positional[1]  # DataLoader(dataset, batch_size, ...)
    if size is None:
        return None, "is not an argument of its call there (the DataLoader default, 1)"
    params = fn.params
    named = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    if not isinstance(size, cst.Name) or size.value not in named:
        return None, f"is `{code(size)}` there, not a parameter of {found.function}()"
    if _other_uses(found.resolver, fn, size):
        return None, f"is its parameter `{size.value}`, which {found.function}() also uses otherwise"
    return size.value, ""


def _other_uses(resolver, fn: cst.FunctionDef, read: cst.Name) -> bool:
    """`fn` names its parameter `read.value` other than in `read` (a read elsewhere, a binding,
    a nested function's use): a value the call divides would change those too."""
    uses = 0
    for name in resolver.descendants(fn.body, cst.Name):
        if name.value != read.value or name is read:
            continue
        parent = resolver.parent(name)
        if isinstance(parent, cst.Attribute) and parent.attr is name:
            continue  # `x.batch_size`: an attribute, not the parameter
        if isinstance(parent, cst.Arg) and parent.keyword is name:
            continue  # `f(batch_size=...)`: a keyword, not the parameter
        uses += 1
    return uses > 0


def _argument_for(params: cst.Parameters, param: str, call: cst.Call) -> tuple:
    """(the value `call` passes for `param`, "") or (None, why it cannot be told or there is none)."""
    explicit = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == param), None)
    if explicit is not None:
        return explicit, ""
    order = [p.name.value for p in (*params.posonly_params, *params.params)]
    positional = []
    for arg in call.args:
        if arg.star:
            return None, f"is its parameter `{param}`, which the call may set through `{arg.star}{code(arg.value)}`"
        if arg.keyword is None:
            positional.append(arg.value)
    if param in order and order.index(param) < len(positional):
        return positional[order.index(param)], ""
    return None, f"is its parameter `{param}`, which the call does not pass (its default is used)"


def _with_param(params: cst.Parameters, new: cst.Param) -> cst.Parameters:
    """`params` with `new` (which has a default) last among the ordinary parameters, or among
    the keyword-only ones after a `*`."""
    if not isinstance(params.star_arg, cst.MaybeSentinel) or params.kwonly_params:
        return params.with_changes(kwonly_params=(*_commas(params.kwonly_params), new))
    return params.with_changes(params=(*_commas(params.params), new))


def _commas(params) -> List[cst.Param]:
    """`params` each followed by a comma (the last one's added, keeping a multi-line layout's)."""
    out = list(params)
    if out and isinstance(out[-1].comma, cst.MaybeSentinel):
        out[-1] = out[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return out
