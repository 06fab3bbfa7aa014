"""checkpoint: no torch.save of sharded state; save it with torch.distributed.checkpoint."""
from __future__ import annotations

from typing import Dict, Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.names import assigned_names
from fsdp2_retrofit.stage import RetrofitStage, StatementEditor

SAVE = {"torch.save", "torch.serialization.save"}
COPIES = {"shutil.copy", "shutil.copyfile", "shutil.copy2"}
READERS = {"torch.load", "shutil.move", "builtins.open", "os.path.getsize"} | COPIES
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
        self.saved: Dict[str, str] = {}  # path key -> the path as written at the save
        for call in _calls(facts, SAVE):
            self._convert(call, facts, editor)
        if self.saved:
            self._convert_readers(facts, editor)

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
        self.saved[_path_key(path, facts)] = code(path)
        self.change(
            call,
            f"torch.save -> dcp.save of {', '.join(kinds)}(...); `{code(path)}` is now a checkpoint directory",
            "each rank holds only its shards; DCP writes them in parallel and can reshard on load "
            "(one file: torch.distributed.checkpoint.format_utils.dcp_to_torch_save)",
            "torch.save of sharded state writes one rank's DTensor shards, not a loadable model",
        )

    def _convert_readers(self, facts: ScriptFacts, editor: _SaveEditor) -> None:
        """Code that reads a path this script now writes as a DCP directory: a load into
        the model becomes dcp.load + set_model_state_dict; a file copy becomes a copy
        of the directory on rank 0; anything else is reported."""
        for call in _calls(facts, READERS):
            if not call.args or _path_key(call.args[0].value, facts) not in self.saved:
                continue
            path = code(call.args[0].value)
            stmt = facts.resolver.statement_of(call)
            model = _loaded_model(stmt, call, facts)
            if model is not None:
                state = self.fresh_name("state_dict", facts.resolver.enclosing_function(stmt))
                lines = [
                    f"{state} = get_model_state_dict({model})\n",
                    f"dcp.load({state}, checkpoint_id={path})\n",
                    f"set_model_state_dict({model}, {state})\n",
                ]
                new = [self.stmt(line) for line in lines]
                editor.replace(stmt, new[0].with_changes(leading_lines=stmt.leading_lines))
                editor.insert_after(stmt, new[1:])
                self.add_import(STATE_DICT_MODULE, "get_model_state_dict")
                self.add_import(STATE_DICT_MODULE, "set_model_state_dict")
                self.change(
                    stmt,
                    f"load `{path}` with dcp.load into the sharded `{model}` (set_model_state_dict)",
                    "the checkpoint is now a DCP directory of shards; each rank loads its own",
                    "torch.load of a DCP directory fails; plain tensors loaded into DTensor parameters are wrong",
                )
            elif _is_statement_call(stmt, call) and facts.resolver.is_call_to(call, COPIES) and len(call.args) == 2:
                dst = code(call.args[1].value)
                editor.replace(
                    stmt,
                    self.stmt(
                        f"if dist.get_rank() == 0:\n    shutil.copytree({path}, {dst}, dirs_exist_ok=True)\n"
                    ).with_changes(leading_lines=stmt.leading_lines),
                )
                self.add_import("torch.distributed", asname="dist")
                self.change(
                    stmt,
                    f"copy the checkpoint directory `{path}` with shutil.copytree, on rank 0",
                    "the checkpoint is now a directory; one rank copies it (a plain file operation)",
                    "copyfile of a directory fails",
                )
            else:
                self.attention(
                    call,
                    f"reads `{path}`, which is now a DCP checkpoint directory",
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


def _path_key(expr, facts: ScriptFacts) -> str:
    """A path's text, seeing through a name bound once in the function (`best_path = ...`)."""
    if isinstance(expr, cst.Name):
        function = facts.resolver.enclosing_function(expr)
        values = [
            s.body[0].value
            for s in facts.resolver.nodes(cst.SimpleStatementLine)
            if len(s.body) == 1
            and isinstance(s.body[0], cst.Assign)
            and expr.value in assigned_names(s)
            and facts.resolver.enclosing_function(s) is function
        ]
        if len(values) == 1:
            return code(values[0])
    return code(expr)


def _is_statement_call(stmt, call) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and stmt.body[0].value is call
    )


def _loaded_model(stmt, load: cst.Call, facts: ScriptFacts):
    """`model` for the statement `model.load_state_dict(torch.load(...))` of a sharded model."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr)):
        return None
    outer = stmt.body[0].value
    if not (
        isinstance(outer, cst.Call)
        and isinstance(outer.func, cst.Attribute)
        and outer.func.attr.value == "load_state_dict"
        and isinstance(outer.func.value, cst.Name)
        and len(outer.args) == 1
        and outer.args[0].value is load
    ):
        return None
    name = outer.func.value.value
    return name if facts.is_model_name(name, stmt) else None
