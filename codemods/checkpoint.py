"""checkpoint: no torch.save of sharded state; save it with torch.distributed.checkpoint."""
from __future__ import annotations

from typing import Dict, Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.names import assigned_names
from fsdp2_retrofit.stage import RetrofitStage, StatementEditor

SAVE = {"torch.save", "torch.serialization.save"}
READERS = {"torch.load", "shutil.copy", "shutil.copyfile", "shutil.copy2", "shutil.move", "open", "os.path.getsize"}
STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"


class _SaveEditor(StatementEditor):
    def __init__(self) -> None:
        super().__init__()
        self.exprs: Dict[cst.CSTNode, cst.BaseExpression] = {}  # state_dict() calls -> replacements
        self.saves: Dict[cst.Call, cst.BaseExpression] = {}  # torch.save calls -> `dcp.save` callee

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call):
        if original_node in self.exprs:
            return self.exprs[original_node]
        if original_node in self.saves:
            state, path = updated_node.args[0], updated_node.args[1]
            updated_node = updated_node.with_changes(
                func=self.saves[original_node],
                args=[
                    state.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT),
                    path.with_changes(
                        keyword=cst.Name("checkpoint_id"),
                        equal=cst.AssignEqual(
                            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                        ),
                        comma=path.comma if len(updated_node.args) == 2 else cst.MaybeSentinel.DEFAULT,
                    ),
                ],
            )
        return updated_node


class ConvertSavesCommand(RetrofitStage):
    DESCRIPTION = "Turn torch.save of model/optimizer state into dcp.save of get_*_state_dict()."
    CODE = "checkpoint"

    def make_editor(self) -> StatementEditor:
        return _SaveEditor()

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: _SaveEditor) -> None:
        if not facts.models:
            return
        for call in _calls(facts, SAVE):
            self._convert(call, facts, editor)

    def _convert(self, call: cst.Call, facts: ScriptFacts, editor: _SaveEditor) -> None:
        if len(call.args) < 2:
            return
        function = facts.resolver.enclosing_function(call)
        models = facts.model_names.get(function, set())
        optimizers = facts.optimizer_names.get(function, {})
        obj = call.args[0].value
        target = obj
        if isinstance(obj, cst.Name):
            target = _bound_value(obj.value, call, facts)
            if target is None:
                return
        if isinstance(target, cst.Name) and target.value in models:
            self.attention(
                call,
                f"`torch.save({target.value}, ...)` pickles the whole sharded module",
                "the file holds one rank's shards and is not loadable as a model; save a state dict instead",
            )
            return
        edits = self._state_edits(target, models, optimizers)
        if not edits:
            return
        for node, replacement in edits.items():
            editor.exprs[node] = self.expr(replacement)
        path = call.args[1].value
        editor.saves[call] = self.expr("dcp.save")
        editor.mark_work()
        self.add_import("torch.distributed.checkpoint", asname="dcp")
        kinds = sorted({"get_model_state_dict" if "model_state" in r else "get_optimizer_state_dict" for r in edits.values()})
        for kind in kinds:
            self.add_import(STATE_DICT_MODULE, kind)
        self._flag_readers(call, path, facts)
        self.change(
            call,
            f"torch.save -> dcp.save of {', '.join(kinds)}(...); `{code(path)}` is now a checkpoint directory",
            "each rank holds only its shards; DCP writes them in parallel and can reshard on load "
            "(one file: torch.distributed.checkpoint.format_utils.dcp_to_torch_save)",
            "torch.save of sharded state writes one rank's DTensor shards, not a loadable model",
        )

    def _flag_readers(self, save: cst.Call, path, facts: ScriptFacts) -> None:
        """Code that reads the saved path as a file will now find a directory."""
        target = code(path)
        for call in _calls(facts, READERS):
            if call is not save and any(code(a.value) == target for a in call.args):
                self.attention(
                    call,
                    f"reads `{target}`, which is now a DCP checkpoint directory",
                    "load it with dcp.load into get_model_state_dict(model) and set_model_state_dict, "
                    "or copy it with shutil.copytree (on one rank)",
                )

    def _state_edits(self, target, models, optimizers) -> Dict[cst.CSTNode, str]:
        """`m.state_dict()` / `opt.state_dict()` calls in the saved object -> replacements."""
        edits: Dict[cst.CSTNode, str] = {}
        for call in _state_dict_calls(target):
            owner = call.func.value
            if not isinstance(owner, cst.Name):
                continue
            if owner.value in models:
                edits[call] = f"get_model_state_dict({owner.value})"
            elif owner.value in optimizers and optimizers[owner.value]:
                edits[call] = f"get_optimizer_state_dict({optimizers[owner.value]}, {owner.value})"
        return edits


def _calls(facts: ScriptFacts, names):
    found = []

    class _C(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if facts.resolver.is_call_to(node, names):
                found.append(node)

    facts.module.visit(_C())
    return found


def _state_dict_calls(node):
    found = []

    class _S(cst.CSTVisitor):
        def visit_Call(self, n: cst.Call) -> None:
            if isinstance(n.func, cst.Attribute) and n.func.attr.value == "state_dict" and not n.args:
                found.append(n)

    node.visit(_S())
    return found


def _bound_value(name: str, call: cst.Call, facts: ScriptFacts) -> Optional[cst.BaseExpression]:
    """The value `name` was last given in the same block before the save."""
    stmt = facts.resolver.statement_of(call)
    block = facts.resolver.block_of(stmt)
    if block is None:
        return None
    body = list(block.body)
    for earlier in reversed(body[: body.index(stmt)]):
        if name in assigned_names(earlier):
            small = earlier.body[0]
            return small.value if isinstance(small, cst.Assign) and len(earlier.body) == 1 else None
    return None
