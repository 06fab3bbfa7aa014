"""shared_names: a run folder named from the clock (or a uuid) is named once, by rank 0.

`run_dir = os.path.join(args.runs, time.strftime("%Y%m%d-%H%M%S"))` runs on every rank,
and each rank reads its own clock: where the value reaches a path every rank uses (the
checkpoint, now one collective DCP save whose shards must land in one folder; a folder
every rank creates; a log file), each rank would write into a folder of its own. Right
after the binding, on every rank (never under a rank-0 `if`: it is a collective), rank
0's value is broadcast and bound again:

    run_dir_shared = [run_dir]
    dist.broadcast_object_list(run_dir_shared, src=0)
    run_dir = run_dir_shared[0]

The values are found by value (analysis/rank_local.py). Where the process group is not
started yet at the binding (a module-level name, a function called before
init_process_group), or where the value is used without a name to bind again (an
f-string handed straight to the save, `self.run_dir`, a function's result used in
place), the file is refused at the line that makes it."""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.rank_local import every_rank_binds, rank_local_names, source_kind
from fsdp2_retrofit.rewrite.stage import DEFERRED_IMPORTS_KEY, RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import attr_path, code, walk


class ShareRankLocalNamesCommand(RetrofitStage):
    DESCRIPTION = "Broadcast rank 0's clock- or uuid-made run name to every rank before a shared path reads it."
    CODE = "shared_names"

    @classmethod
    def may_edit(cls, earlier: ScriptFacts) -> bool:
        """Only a clock or id call the user wrote makes a rank-local name (no stage writes one)."""
        r = earlier.resolver
        return any(source_kind(call, r) for call in r.nodes(cst.Call))

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if facts.distributed_init is None:
            return
        self._see_pending_imports(facts)
        for record in rank_local_names(facts):
            sink = record.sinks[0]
            uses = f"`{code(sink.func)}(...)` on line {self.line(sink)}"
            if record.binding is None:
                self.refuse(
                    "FSR636",
                    record.source,
                    f"`{code(record.source)}` names a path every rank uses ({uses}): {record.lost}",
                    f"each rank reads {record.what} itself and gets another name: each would write into a "
                    "path of its own (a collective checkpoint save split over folders); the rewrite hands rank 0's "
                    "value to the other ranks only through a plain name or `obj.attr` it can bind again",
                    "bind the name first (`run_dir = ...`) in the function that uses it",
                )
                continue
            if not every_rank_binds(record, facts):
                continue  # bound on rank 0 only: the checkpoint stage broadcasts it where a save reads it
            anchor = self._anchor(record.binding, facts)
            target = code(record.target)
            if anchor is None:
                self.refuse(
                    "FSR635",
                    record.binding,
                    f"`{target}` is made from {record.what} (`{code(record.source)}`) before the process group "
                    f"starts, and {uses} reads it",
                    f"each rank gets another name: each would write into a path of its own; rank 0's value can be "
                    "broadcast only once the process group runs, and here the name is bound (or read) before "
                    "init_process_group",
                    f"bind `{target}` after the process group starts (in the function that starts it), or pass "
                    "the name in as an argument",
                )
                continue
            scope = facts.resolver.enclosing_function(record.binding)
            box = self.fresh_name(f"{attr_path(record.target)[-1]}_shared", scope)
            editor.insert_after(anchor, [
                self.stmt(f"{box} = [{target}]\n"),
                self.stmt(f"dist.broadcast_object_list({box}, src=0)  # every rank: one name for the run\n"),
                self.stmt(f"{target} = {box}[0]\n"),
            ])
            self.add_import("torch.distributed", asname="dist")
            self.change(
                record.binding,
                f"`{target}` is made from {record.what} (`{code(record.source)}`): rank 0's value is broadcast to "
                "every rank" + (" after init_process_group" if anchor is not record.binding else ""),
                f"{uses} runs on every rank and reads it: each rank would name its own path",
                "a collective checkpoint save into a folder per rank, logs scattered over folders",
            )

    def _see_pending_imports(self, facts: ScriptFacts) -> None:
        """The imports earlier stages asked for are added at the very end: resolve the names
        they bind (`dcp.save(...)` the checkpoint stage wrote) as they will be."""
        pending = {}
        for module, obj, asname in self.context.scratch.get(DEFERRED_IMPORTS_KEY) or []:
            if obj is None:
                pending[asname or module.split(".")[0]] = module if asname else module.split(".")[0]
            else:
                pending[asname or obj] = f"{module}.{obj}"
        facts.resolver.add_bindings(pending)

    def _anchor(self, binding, facts: ScriptFacts) -> Optional[cst.CSTNode]:
        """The statement the broadcast goes after: the binding, where the process group is
        started before it runs (earlier in a block around both; or in a function whose every
        call comes after the start); init's statement, where the binding comes before it in
        the same block and nothing reads the name in between; None otherwise."""
        r = facts.resolver
        init = facts.distributed_init
        if r.enclosing_function(binding) is r.enclosing_function(init):
            block = _common_block(binding, init, r)
            body = list(block.body) if block is not None else []
            top, init_top = _top_in(binding, body, r), _top_in(init, body, r)
            if top is None or init_top is None or top is init_top:
                return None
            if body.index(top) > body.index(init_top):
                return binding
            if top is not binding:
                return None  # bound inside a loop or branch before the start: not moved
            path = attr_path(record_target(binding))
            between = body[body.index(top) + 1: body.index(init_top)]
            if any(_reads(s, path, r) for s in between):
                return None
            return init_top
        fn = r.enclosing_function(binding)
        if fn is None:
            return None  # module level, the group started in a function: at import time, before it
        calls = [call for call, _ in facts.analysis.flow.bound_calls(fn)]
        for call in calls:
            block = _common_block(call, init, r)
            body = list(block.body) if block is not None else []
            top, init_top = _top_in(call, body, r), _top_in(init, body, r)
            if top is None or init_top is None or top is init_top or body.index(top) <= body.index(init_top):
                return None
        return binding if calls else None


def record_target(binding: cst.SimpleStatementLine):
    small = binding.body[0]
    return small.targets[0].target if isinstance(small, cst.Assign) else small.target


def _reads(stmt, path, r) -> bool:
    """`stmt` reads `name` (or `obj.attr`, or `obj` whole)."""
    for node in walk(stmt):
        if isinstance(node, (cst.Name, cst.Attribute)):
            parent = r.parent(node)
            if isinstance(parent, cst.Attribute) and parent.value is node:
                continue  # the outermost attribute says what is read
            found = attr_path(node)
            if found and (found == path[: len(found)] or found[: len(path)] == path):
                return True
    return False


def _common_block(a, b, r):
    """The innermost block (an indented body or the module) holding both nodes."""
    around_b = {id(n) for n in r.ancestors(b)}
    for anc in r.ancestors(a):
        if isinstance(anc, (cst.IndentedBlock, cst.Module)) and id(anc) in around_b:
            return anc
    return None


def _top_in(node, body: list, r):
    """The statement of `body` that is or holds `node`; None if none does."""
    ids = {id(s) for s in body}
    for anc in [node, *r.ancestors(node)]:
        if id(anc) in ids:
            return anc
    return None
