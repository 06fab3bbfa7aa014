"""checkpoint_files: a checkpoint saved or loaded through a file object
(`with open(path, "wb") as f: torch.save(state, f)`, `torch.load(f)`) is given the
path itself, so that the checkpoint and resume stages can make it a DCP directory
(dcp.save / dcp.load take a path, never a file object) or a full-state load."""
from __future__ import annotations

from typing import Set

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.checkpoints import LOAD, SAVE, call_arg, calls_to, file_object, loads, save_format, saves
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor


class UseCheckpointPathsCommand(RetrofitStage):
    DESCRIPTION = "Give torch.save / torch.load of model or optimizer state the path instead of a file object."
    CODE = "checkpoint_files"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        # the saves and loads of model or optimizer state: refused where the path cannot
        # take the file object's place; any other save or load through a file object of
        # its own `with` is given the path too (the same file: a save's state may be bound
        # in an outer block, which the analysis of saves sees only once the `with` is gone)
        state = {id(s.call) for s in saves(facts) if save_format(s, self.options.export) is not None}
        state |= {id(s.call) for s in loads(facts) if s.loads_state}
        targets = [(c, call_arg(c, 1, "f"), True) for c in calls_to(facts, SAVE)]
        targets += [(c, call_arg(c, 0, "f"), False) for c in calls_to(facts, LOAD)]
        done: Set[int] = set()
        for call, arg, writing in targets:
            found = file_object(call, arg, writing, facts) if arg is not None else None
            if found is None or (found.path is None and id(call) not in state):
                continue
            if found.path is None and writing:
                self.refuse("FSR705", call, *_refusal(found, "saved to"))
            if found.path is None:
                self.refuse("FSR803", call, *_refusal(found, "loaded from"))
            if id(found.with_stmt) in done:
                continue
            done.add(id(found.with_stmt))
            self._unwrap(found.with_stmt, arg, found.path, editor)
            self.change(
                found.with_stmt,
                f"`{code(call)}` in `with open({code(found.path)}, ...) as {found.name}:` -> "
                f"torch.{'save' if writing else 'load'} of the path `{code(found.path)}`",
                "the checkpoint stages make it a DCP directory (or a full-state load): they need the path",
                "dcp.save / dcp.load of a file object fail (TypeError); the opened file would also "
                "shadow the directory",
            )

    def _unwrap(self, stmt: cst.With, name: cst.Name, path: cst.BaseExpression, editor: StatementEditor) -> None:
        """`with open(path, mode) as f: body` -> body, with `path` in place of `f`."""

        class _Swap(cst.CSTTransformer):
            def leave_Name(self, original_node, updated_node):
                return path.deep_clone() if original_node is name else updated_node

        body = list(stmt.body.body)
        new = [s.visit(_Swap()) for s in body]
        new[0] = new[0].with_changes(leading_lines=[*stmt.leading_lines, *new[0].leading_lines])
        for old, replacement in zip(body, new):
            self.carry(old, replacement)
        editor.replace(stmt, new[0])
        editor.insert_after(stmt, new[1:])


def _refusal(found, what: str):
    return (
        f"model or optimizer state {what} a file object (`{found.name}`): {found.problem}",
        "the sharded state is written as a DCP checkpoint directory and read back with dcp.load, "
        "which take a path, not a file object",
        "save and load by path: torch.save(state, path) / torch.load(path)",
    )
