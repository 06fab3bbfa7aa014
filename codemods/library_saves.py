"""library_saves: `model.save_pretrained(dir)` of a sharded library model gathers the
full state on every rank, then writes it on rank 0."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.checkpoints import rank_gate
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.torch_api import STATE_DICT_MODULE


class GatherLibrarySavesCommand(RetrofitStage):
    DESCRIPTION = "save_pretrained of a sharded transformers model: gather the full state dict, write it on rank 0."
    CODE = "library_saves"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not any(m.library is not None for m in facts.models):
            return
        for stmt in facts.resolver.nodes(cst.SimpleStatementLine):
            call = stmt.body[0].value if len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr) else None
            func = call.func if isinstance(call, cst.Call) else None
            if not (isinstance(func, cst.Attribute) and func.attr.value == "save_pretrained"
                    and isinstance(func.value, cst.Name) and facts.is_model_name(func.value.value, stmt)):
                continue
            self._gather(stmt, call, func.value.value, facts, editor)

    def _gather(self, stmt, call: cst.Call, name: str, facts: ScriptFacts, editor: StatementEditor) -> None:
        given = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "state_dict"), None)
        if given is not None and _gathered_just_before(given, stmt, facts):
            return  # already `full_state = get_model_state_dict(...)`, then the gated save
        if given is not None:
            self.refuse(
                "FSR702",
                stmt, f"`{code(call.func)}` is given its own state_dict",
                "which state it writes is for the script to say; a state dict of a sharded model holds one "
                "rank's shards",
                f"pass state_dict=get_model_state_dict({name}, options=StateDictOptions(full_state_dict=True, "
                "cpu_offload=True)), gathered on every rank, and call it on rank 0 only",
            )
        if rank_gate(stmt, facts) is not None:
            self.refuse(
                "FSR703",
                stmt, f"`{code(call.func)}` under a rank test",
                "gathering the full state dict is a collective every rank must join: under a rank-0 `if` "
                "the other ranks never do (deadlock)",
                "call save_pretrained outside the rank test; the rewrite gates the write itself",
            )
        test = self.rank_zero_test(stmt, facts) or "dist.get_rank() == 0"
        state = self.fresh_name("full_state", facts.resolver.enclosing_function(stmt))
        args = ", ".join([code(a).rstrip(",").strip() for a in call.args] + [f"state_dict={state}"])
        gather = self.stmt(
            f"{state} = get_model_state_dict({name}, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
        )
        editor.insert_before(stmt, [gather])
        editor.replace(stmt, self.stmt(f"if {test}:\n    {code(call.func)}({args})\n"))
        self.add_import(STATE_DICT_MODULE, "get_model_state_dict")
        self.add_import(STATE_DICT_MODULE, "StateDictOptions")
        self.add_import("torch.distributed", asname="dist")
        self.change(
            stmt,
            f"`{code(call.func)}` writes the full state dict, gathered on every rank, on rank {test} only"
            .replace(f"rank {test}", "rank 0"),
            "after fully_shard each rank holds only its shards: get_model_state_dict with full_state_dict "
            "all-gathers them (a collective: every rank), into CPU memory; one rank writes the files",
            "save_pretrained of the sharded model writes one rank's pieces, or fails on DTensors",
        )


def _gathered_just_before(value, stmt, facts: ScriptFacts) -> bool:
    """`value` is a name the statement before the `if` around `stmt` binds to get_model_state_dict(...)."""
    gate = facts.resolver.parent(facts.resolver.parent(stmt))  # stmt -> IndentedBlock -> If
    if not isinstance(value, cst.Name) or not isinstance(gate, cst.If):
        return False
    block = facts.resolver.block_of(gate)
    body = list(block.body) if block is not None else []
    before = body[body.index(gate) - 1] if gate in body and body.index(gate) > 0 else None
    small = before.body[0] if isinstance(before, cst.SimpleStatementLine) and len(before.body) == 1 else None
    return (
        isinstance(small, cst.Assign) and code(small.targets[0].target) == value.value
        and any(q.endswith("get_model_state_dict") for q in facts.resolver.qnames(small.value))
    )
