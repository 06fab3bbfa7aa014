"""migrate_ddp: a DDP or DataParallel script becomes a script of one plain model
that the later stages shard like a single-GPU one (the wrapper goes, `.module`
goes, `no_sync()` becomes `set_requires_gradient_sync`)."""
from __future__ import annotations

from typing import List

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.wrappers import DATA_PARALLEL, DDP, WrapSite, context_withs, reads_of, wrappers
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

from .accumulation import TRADE, _negate, hold_parameters

# DDP/DataParallel arguments that have no FSDP2 counterpart, and why dropping them is safe
DROPPED = {
    "device_ids": "fully_shard puts each unit on the mesh's device; set_device(local_rank) chose it",
    "output_device": "outputs stay on the device the forward ran on, as with one GPU per process",
    "dim": "no scatter of the batch: each process reads its own batch",
    "find_unused_parameters": "FSDP2 reduce-scatters every parameter of a unit; one that got no gradient "
    "contributes zeros, nothing waits for it",
    "broadcast_buffers": "FSDP2 does not broadcast buffers each forward; every rank keeps its own (equal as long as "
    "they are computed from equal inputs; BatchNorm statistics become per-rank)",
    "gradient_as_bucket_view": "DDP bucket tuning; FSDP2 reduce-scatters each unit's gradients itself",
    "bucket_cap_mb": "DDP bucket tuning; FSDP2 reduce-scatters each unit's gradients itself",
    "static_graph": "DDP graph-caching hint; FSDP2 needs none",
    "check_reduction": "deprecated DDP argument without effect",
}


def _collapsed(choice: cst.IfExp) -> cst.BaseExpression:
    """`a if c else a` (both sides the same once `.module` is gone) -> `a`."""
    return choice.body if code(choice.body) == code(choice.orelse) else choice


class MigrateDistributedWrappersCommand(RetrofitStage):
    DESCRIPTION = "Remove DistributedDataParallel / DataParallel wrappers (and .module, no_sync) so the model can be sharded."
    CODE = "migrate_ddp"

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        tree = super().transform_module_impl(tree)
        return self.remove_unused_imports(tree)

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        found = wrappers(facts)
        if not found.sites and not found.other_calls:
            return
        self._refuse_unsafe(found, facts)
        for site in found.sites:
            self._unwrap(site, facts, editor)
        choices = set()
        for attr in found.module_accesses:
            editor.replace_expression(attr, lambda updated: updated.value)
            parent = facts.resolver.parent(attr)
            if isinstance(parent, cst.IfExp) and parent not in choices:
                choices.add(parent)
                editor.replace_expression(parent, _collapsed)
        for call in found.module_getattrs:
            editor.replace_expression(call, call.args[0].value)
        accesses = found.module_accesses + found.module_getattrs
        if accesses:
            self.change(
                accesses[0],
                f"`.module` of the wrapped model goes ({len(accesses)} place(s))",
                "without a wrapper the model is the module itself; the checkpoint stage then saves it with "
                "get_model_state_dict",
            )
        for w in found.no_sync_withs:
            self._no_sync_with(w, facts, editor)
        for stmt, name, (negated, test), call in found.no_sync_choices:
            self._no_sync_choice(stmt, name, negated, test, call, facts, editor)
        for stmt in found.grad_sync_flags:
            assign = stmt.body[0]
            model = code(assign.targets[0].target.value)
            editor.replace(stmt, stmt.with_changes(body=[cst.Expr(self.expr(
                f"{model}.set_requires_gradient_sync({code(assign.value)})"
            ))]))
            editor.insert_after(stmt, hold_parameters(self, stmt, model, code(assign.value)))
            self.change(
                stmt,
                f"`{model}.require_backward_grad_sync = ...` -> `{model}.set_requires_gradient_sync(...)`",
                TRADE,
                "DDP's require_backward_grad_sync does nothing on an FSDP2 module",
            )
        self._remove_imports(facts)

    # -- the wrapper -----------------------------------------------------------

    def _refuse_unsafe(self, found, facts: ScriptFacts) -> None:
        for call in found.other_calls:
            self.refuse(
                "FSR201",
                call,
                f"`{code(call.func)}(...)` {_where_it_goes(call, facts.resolver)}, not assigned to a name "
                "(or to an attribute of `self` in a method) on its own line",
                "the migration replaces `model = DDP(model, ...)` and `self.model = DDP(self.model, ...)` statements; "
                "a wrapper built inside another expression (returned, passed on, stored in a container or in "
                "another object's attribute) cannot be followed",
                "wrap the model on its own line: `model = DDP(model, device_ids=[local_rank])`",
            )
        for node in found.other_uses:
            self.refuse(
                "FSR202",
                node,
                f"`{code(facts.resolver.statement_of(node) or node)}` uses the wrapper class itself",
                "after the migration no model is a DistributedDataParallel/DataParallel; an isinstance test or a "
                "subclass would change meaning",
                "drop the test (the model is never wrapped after the rewrite) and run rewrite again",
            )
        for call in found.no_sync_calls:
            self.refuse(
                "FSR203",
                call,
                "`no_sync()` is used outside a `with` statement or a `ctx = model.no_sync() if ... else nullcontext()` choice",
                "FSDP2 has no no_sync context; the migration turns those two shapes into set_requires_gradient_sync",
                "use `with model.no_sync():` around the backward of the micro-batches that must not sync",
            )
        ddp = [s for s in found.sites if s.kind == "DistributedDataParallel"]
        if ddp and found.rank_seeds:
            self.refuse(
                "FSR204",
                found.rank_seeds[0],
                "the random seed depends on the rank",
                "DDP copies rank 0's weights to every rank when it wraps the model; fully_shard keeps each rank's "
                "own slice of its own weights, so a model built with a per-rank seed would mix initialisations",
                "seed the model build with the same value on every rank (seed data augmentation separately)",
            )
        if facts.models and any(s.kind == "DataParallel" for s in found.sites) and ddp:
            self.refuse("FSR205", ddp[0].stmt, "the script uses both DataParallel and DistributedDataParallel",
                        "one process per device cannot be derived from both", "keep one of them")
        for site in found.sites:
            for key in site.kwargs:
                if key not in DROPPED:
                    self.refuse(
                        "FSR206",
                        site.stmt,
                        f"`{key}=` of {site.kind} has no FSDP2 counterpart the rewrite knows",
                        "dropping it could change what the script does (e.g. a process_group other than the "
                        "world needs a matching device mesh)",
                        f"remove `{key}=` (or build the mesh by hand) and run rewrite again",
                    )

    def _unwrap(self, site: WrapSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        if code(site.inner) == site.name:  # `model = DDP(model)`, `self.model = DDP(self.model)`
            holder = facts.resolver.parent(facts.resolver.parent(site.stmt))
            if isinstance(holder, cst.If) and holder.orelse is None and len(holder.body.body) == 1:
                # `if torch.cuda.device_count() > 1: model = DataParallel(model)`: the if goes too
                site = WrapSite(site.name, holder, site.call, site.kind, site.inner, site.kwargs)
            editor.replace(site.stmt, None)
            if site.stmt.leading_lines:
                body = list(facts.resolver.block_of(site.stmt).body)
                following = body[body.index(site.stmt) + 1] if body.index(site.stmt) + 1 < len(body) else None
                if following is not None:
                    editor.set_leading_lines(following, list(site.stmt.leading_lines) + list(following.leading_lines))
            what = f"`{code(site.stmt)}` goes"
        else:
            editor.replace_expression(site.call, site.inner)
            what = f"`{site.name} = {code(site.inner)}` without the {site.kind} wrapper" + (
                f" (`{site.name}` is another name for the sharded `{site.inner.value}`)"
                if isinstance(site.inner, cst.Name) else ""
            )
        why = (
            "fully_shard (added after the model is built) replaces DDP: it reduce-scatters gradients "
            "instead of all-reducing full copies, and each rank keeps 1/world_size of the parameters, "
            "gradients and optimizer state"
            if site.kind == "DistributedDataParallel"
            else "DataParallel runs one process over all GPUs; the script becomes a torchrun script with one "
            "process per GPU, each rank holding 1/world_size of the model (fully_shard)"
        )
        self.change(site.stmt, what, why)
        for key, value in site.kwargs.items():
            self.change(site.stmt, f"dropped `{key}={code(value)}` of {site.kind}", DROPPED[key])

    # -- no_sync -----------------------------------------------------------------

    def _no_sync_with(self, w: cst.With, facts: ScriptFacts, editor: StatementEditor) -> None:
        r = facts.resolver
        item = next(i for i in w.items if isinstance(i.item, cst.Call) and i.item.func.attr.value == "no_sync")
        model = code(item.item.func.value)
        body = list(w.body.body) if isinstance(w.body, cst.IndentedBlock) else None
        if body is None:
            self.refuse("FSR203", w, "a one-line `with ...no_sync(): ...`", "the body cannot be moved", "put the body on its own lines")
        rest = [i for i in w.items if i is not item]
        inner: List[cst.BaseStatement] = body
        if rest:
            rest[-1] = rest[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            inner = [w.with_changes(items=rest)]
        parent = r.parent(r.parent(w))  # With -> IndentedBlock -> If / Else
        branch = r.parent(w)
        if (
            not rest
            and isinstance(parent, (cst.If, cst.Else))
            and len(branch.body) == 1
        ):
            the_if = parent if isinstance(parent, cst.If) else r.parent(parent)
            # (an `elif` is no statement of a block: the generic form below handles it)
            if isinstance(the_if, cst.If) and isinstance(the_if.orelse, cst.Else) and r.block_of(the_if) is not None:
                in_body = parent is the_if
                other = the_if.orelse.body if in_body else the_if.body
                if [code(s) for s in other.body[: len(body)]] == [code(s) for s in body]:
                    # the synced branch starts like the no_sync body: that part runs on every
                    # micro-batch, after set_requires_gradient_sync(<last>); the rest stays under `if <last>`
                    last = _negate(the_if.test) if in_body else code(the_if.test)
                    first = self.stmt(f"{model}.set_requires_gradient_sync({last})\n").with_changes(
                        leading_lines=the_if.leading_lines
                    )
                    tail = list(other.body[len(body):])
                    after = [cst.If(test=self.expr(last), body=other.with_changes(body=tail))] if tail else []
                    held = hold_parameters(self, the_if, model, last)
                    editor.insert_before(the_if, [first] + held + body + after)
                    editor.replace(the_if, None)
                    self.change(
                        the_if,
                        f"`if {code(the_if.test)}: with {model}.no_sync(): ... else: ...` -> "
                        f"`{model}.set_requires_gradient_sync({last})` before the same backward"
                        + (f", the rest under `if {last}:`" if tail else ""),
                        TRADE,
                        "DDP's no_sync() does not exist on an FSDP2 module",
                    )
                    return
        off = self.stmt(f"{model}.set_requires_gradient_sync(False)\n").with_changes(leading_lines=w.leading_lines)
        on = self.stmt(f"{model}.set_requires_gradient_sync(True)\n")
        held = hold_parameters(self, w, model, "False")
        editor.insert_before(w, [off] + held + inner + [on] + [self.stmt(f"{model}.set_reshard_after_backward(True)\n")
                                                             for _ in held])
        editor.replace(w, None)
        self.change(
            w,
            f"`with {model}.no_sync():` -> `{model}.set_requires_gradient_sync(False)` before its body, "
            "`(True)` after it",
            TRADE,
            "DDP's no_sync() does not exist on an FSDP2 module",
        )

    def _no_sync_choice(self, stmt, name, negated, test, call, facts: ScriptFacts, editor: StatementEditor) -> None:
        r = facts.resolver
        fn = r.enclosing_function(stmt)
        withs = context_withs(facts, name, stmt)
        used = {id(n) for w in withs for i in w.items if isinstance(i.item, cst.Name) for n in [i.item]}
        target = stmt.body[0].targets[0].target
        others = [n for n in reads_of(facts, name, fn) if id(n) not in used and n is not target]
        if others or not withs or any(not isinstance(w.body, cst.IndentedBlock) for w in withs):
            self.refuse(
                "FSR203",
                stmt,
                f"`{name}` holds a no_sync() context used elsewhere than `with {name}:`",
                "the migration replaces the choice by set_requires_gradient_sync and unwraps `with` statements only",
                f"use `{name}` only as `with {name}:`",
            )
        model = code(call.func.value)
        sync = _negate(test) if negated else code(test)
        editor.replace(stmt, stmt.with_changes(body=[cst.Expr(self.expr(f"{model}.set_requires_gradient_sync({sync})"))]))
        editor.insert_after(stmt, hold_parameters(self, stmt, model, sync))
        for w in withs:
            rest = [i for i in w.items if not (isinstance(i.item, cst.Name) and i.item.value == name)]
            if rest:
                rest[-1] = rest[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                editor.replace(w, w.with_changes(items=rest))
            else:
                body = list(w.body.body)
                body[0] = body[0].with_changes(leading_lines=list(w.leading_lines) + list(body[0].leading_lines))
                editor.insert_before(w, body)
                editor.replace(w, None)
        self.change(
            stmt,
            f"`{name} = {model}.no_sync() if ... else nullcontext()` -> `{model}.set_requires_gradient_sync({sync})`; "
            f"`with {name}:` unwrapped",
            TRADE,
            "DDP's no_sync() does not exist on an FSDP2 module",
        )

    def _remove_imports(self, facts: ScriptFacts) -> None:
        from libcst.codemod.visitors import RemoveImportsVisitor  # here: it loads libcst.matchers

        for node in facts.resolver.nodes(cst.ImportFrom):
            if isinstance(node.names, cst.ImportStar) or node.module is None:
                continue
            module = code(node.module)
            for alias in node.names:
                name = code(alias.name)
                asname = code(alias.asname.name) if alias.asname else None
                if f"{module}.{name}" in DDP | DATA_PARALLEL or (module, name) == ("contextlib", "nullcontext"):
                    RemoveImportsVisitor.remove_unused_import(self.context, module, name, asname)
        for node in facts.resolver.nodes(cst.Import):
            for alias in node.names:
                if code(alias.name) == "contextlib" and alias.asname is None:
                    RemoveImportsVisitor.remove_unused_import(self.context, "contextlib")


def _where_it_goes(call: cst.Call, r) -> str:
    """What becomes of a wrapper built where the migration cannot follow it, for FSR201's message."""
    parent = r.parent(call)
    if type(parent) is cst.Assign and parent.value is call:
        targets = [code(t.target) for t in parent.targets]
        return f"is stored in `{' = '.join(targets)}`"
    if type(parent) is cst.Return:
        fn = r.enclosing_function(call)
        return f"is returned by {fn.name.value}()" if fn is not None else "is returned"
    if type(parent) is cst.Arg:
        outer = r.parent(parent)
        return f"is passed to `{code(outer.func)}(...)`" if type(outer) is cst.Call else "is passed on"
    return f"is built inside `{' '.join(code(r.statement_of(call)).split())[:60]}`"
